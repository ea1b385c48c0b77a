"""The trainer's monitor: hooks the training loop calls, cheap no-ops when monitoring is off.

The loop calls, per step::

    monitor.step_begin(step)
    ... sample the batch ...          monitor.phase("data")
    ... forward ...                   monitor.phase("forward")
    ... backward ...                  monitor.phase("backward")
    ... clip + optimizer step ...     monitor.phase("optimizer")
    ... loss all-reduce ...           monitor.step_end(step + 1, loss=..., lr=..., grad_norm=...)

and :meth:`TrainerMonitor.finish` once at the end (collective). ``comm_wait`` is communication
that did not overlap compute: the tail of backward after the last gradient was accumulated (DDP
waiting for its all-reduce) plus the end-of-step loss all-reduce.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from torsh_distributed.monitor import alerts as A
from torsh_distributed.monitor.anomaly import AnomalyTracker
from torsh_distributed.monitor.config import MonitorConfig
from torsh_distributed.monitor.metrics import (
    PHASES,
    Aggregate,
    WindowStats,
    gather,
    memory_limit_bytes,
    rss_bytes,
)
from torsh_distributed.monitor.report import Report, build_report
from torsh_distributed.monitor.trace import PhaseTrace

__all__ = ["TrainerMonitor", "SLOW_RANK_ENV"]

SLOW_RANK_ENV = "TORSH_MONITOR_TEST_SLOW_RANK"
"""Test hook: ``RANK:SECONDS`` makes that rank sleep SECONDS in the data phase of every step."""

_ANOMALY_METRICS = ("step_time_max", "loss", "tokens_per_s", "grad_norm_median")
_HISTORY = 500  # dashboard points per series; when full, every other point is dropped
_PUBLISH_EVERY_S = 1.0  # the page polls once a second; serialising the history costs ~ms


def _finite(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class TrainerMonitor:
    """Per-rank metrics, cross-rank aggregation, alerts, exporters and the end-of-run report.

    Args:
        config: The ``monitor`` section; when nothing in it is enabled every method returns at once.
        rank: This rank.
        world_size: Ranks in the job.
        local_world_size: Ranks on this node (they share its memory).
        device: Device of the aggregation tensor (the process group's device).
        max_steps: Shown on the dashboard.
        samples_per_step: Samples this rank processes per step.
        tokens_per_step: Tokens this rank processes per step.
        params: Parameters whose gradient accumulation marks the end of backward compute.
        echo: Prints a line on rank 0 (the progress bar's ``write``); ``print`` by default.
    """

    def __init__(
        self,
        config: MonitorConfig,
        *,
        rank: int,
        world_size: int,
        local_world_size: int = 1,
        device: torch.device | None = None,
        max_steps: int = 0,
        samples_per_step: int = 0,
        tokens_per_step: int = 0,
        params: Any = (),
        echo: Any = None,
    ) -> None:
        self.config = config
        self.on = config.active
        self.report: Report | None = None
        if not self.on:
            return
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self.main = rank == 0
        self.device = device
        self.max_steps = max_steps
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self._echo = echo or (lambda text: print(text, flush=True))
        self._window = WindowStats()
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._t0 = self._last = self._grad_t = 0.0
        self.history: list[Aggregate] = []
        self.latest: Aggregate | None = None
        self._series: dict[str, list[str]] = {}  # JSON text of each point, formatted once
        self._stride = 1  # record every _stride-th aggregation (doubles when the history is full)
        self._recorded = 0
        self.anomalies = AnomalyTracker(
            _ANOMALY_METRICS, window=config.anomaly_window, threshold=config.anomaly_z
        )
        self._slow = self._parse_slow()
        self._trace = PhaseTrace() if config.trace else None
        self._step = 0
        self._prof_seen = 0
        self._published = 0.0
        self._overhead_s = 0.0  # time in aggregations (collective, alerts, exporters)
        self._aggregations = 0
        self._step_time_s = 0.0
        self._hooks = []
        for p in params:
            if not p.requires_grad:
                continue
            try:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_done))
            except RuntimeError:  # a parameter type without the hook: backward includes the wait
                break
        self.alerts: A.AlertManager | None = None
        self.exporter: Any = None
        self.dashboard: Any = None
        if self.main:
            self.alerts = (
                A.load_alerts(config.alerts, echo=self._echo)
                if config.alerts
                else A.AlertManager(A.default_rules(), [A.LogNotifier(echo=self._echo)])
            )
            if config.metrics_port:
                from torsh_distributed.monitor.prometheus import PrometheusExporter

                self.exporter = PrometheusExporter(
                    job=config.job, host=config.metrics_host, port=config.metrics_port
                )  # OSError naming the address when the port is taken
                self._echo(f"prometheus metrics: http://{config.metrics_host}:{config.metrics_port}/metrics")
            if config.dashboard_port:
                from torsh_distributed.monitor.server import DashboardServer

                self.dashboard = DashboardServer(host=config.dashboard_host, port=config.dashboard_port)
                self._echo(f"live dashboard: {self.dashboard.url}")
                self._publish(done=False)

    def _parse_slow(self) -> float:
        spec = os.environ.get(SLOW_RANK_ENV, "")
        if not spec:
            return 0.0
        try:
            rank, seconds = spec.split(":")
            return float(seconds) if int(rank) == self.rank else 0.0
        except ValueError:
            raise ValueError(f"{SLOW_RANK_ENV} must be RANK:SECONDS, got {spec!r}") from None

    def _grad_done(self, _param: torch.Tensor) -> None:
        self._grad_t = time.perf_counter()

    # --- per-step hooks (hot path) ---

    def step_begin(self, step: int) -> None:
        """Start timing a step."""
        if not self.on:
            return
        self._t0 = self._last = time.perf_counter()
        self._step = step + 1
        if self._slow:
            time.sleep(self._slow)

    def phase(self, name: str) -> None:
        """Close phase ``name`` (one of data, forward, backward, optimizer) at this instant."""
        if not self.on:
            return
        now = time.perf_counter()
        if name == "backward" and self._grad_t > self._last:
            self._phases["backward"] += self._grad_t - self._last
            self._phases["comm_wait"] += now - self._grad_t
            if self._trace is not None:
                self._trace.add(self._step, "backward", self._last, self._grad_t)
                self._trace.add(self._step, "comm_wait", self._grad_t, now)
        else:
            self._phases[name] += now - self._last
            if self._trace is not None:
                self._trace.add(self._step, name, self._last, now)
        self._last = now

    def step_end(self, step: int, *, loss: float, lr: float, grad_norm: Any = None) -> None:
        """Close the step (the rest counts as ``comm_wait``); aggregate every ``config.every`` steps.

        ``step`` is the number of steps done (1-based); collective on aggregation steps.
        """
        if not self.on:
            return
        now = time.perf_counter()
        self._phases["comm_wait"] += now - self._last
        if self._trace is not None:
            self._trace.add(step, "comm_wait", self._last, now)
        w = self._window
        self._step_time_s += now - self._t0
        w.add_step(now - self._t0, self._phases, samples=self.samples_per_step, tokens=self.tokens_per_step)
        self._phases = dict.fromkeys(PHASES, 0.0)
        w.loss, w.lr = loss, lr
        if grad_norm is not None:
            w.grad_norm = grad_norm  # a tensor: converted at aggregation (no device sync per step)
        if step % self.config.every == 0:
            self._aggregate(step)

    def postfix(self) -> dict[str, str]:
        """Progress-bar fields: samples/s of the job and the slowest rank."""
        if not self.on or self.latest is None:
            return {}
        agg = self.latest
        return {"smp_s": f"{agg.samples_per_s:.1f}", "slowest": f"r{agg.slowest_rank} {agg.imbalance:.2f}x"}

    # --- aggregation (collective) ---

    def _comm_window(self) -> tuple[float, float]:
        try:
            from torsh_distributed.comm import profiler
        except ImportError:
            return 0.0, 0.0
        prof = profiler.active()
        if prof is None:
            return 0.0, 0.0
        events = prof.events[self._prof_seen :]
        self._prof_seen = len(prof.events)
        return float(sum(e.nbytes for e in events)), sum(e.dur_us for e in events) * 1e-6

    def _aggregate(self, step: int) -> None:
        start = time.perf_counter()
        self._aggregate_now(step)
        self._overhead_s += time.perf_counter() - start
        self._aggregations += 1

    def _aggregate_now(self, step: int) -> None:
        w = self._window
        w.comm_bytes, w.comm_time = self._comm_window()
        w.grad_norm = float(w.grad_norm)
        cuda = 0.0
        if self.device is not None and self.device.type == "cuda":
            cuda = float(torch.cuda.memory_allocated(self.device))
        agg = gather(w.row(step=step, rss=rss_bytes(), cuda=cuda), device=self.device)
        self._window = WindowStats()
        self.latest = agg
        self.history.append(agg)
        flat = agg.flat()
        self._record_series(agg, flat)
        found = self.anomalies.update(flat, step=step)
        if not self.main:
            return
        assert self.alerts is not None
        if self.dashboard is not None:
            for rule in self.dashboard.pending_acks():
                self.alerts.acknowledge(rule, by="dashboard")
        self.alerts.evaluate(flat, step=step)
        if self.exporter is not None:
            severities: dict[str, int] = {}
            for alert in self.alerts.active():
                severities[alert.severity] = severities.get(alert.severity, 0) + 1
            self.exporter.update(agg, alerts_by_severity=severities)
            for anomaly in found:
                self.exporter.count_anomaly(anomaly.metric)
        if self.dashboard is not None and time.monotonic() - self._published >= _PUBLISH_EVERY_S:
            self._publish(done=False)

    def _record_series(self, agg: Aggregate, flat: dict[str, float]) -> None:
        comm_bytes = sum(agg.column("comm_bytes"))
        comm_time = sum(agg.column("comm_time"))
        point = {
            "step": agg.step,
            "loss": flat["loss"],
            "tokens_per_s": flat["tokens_per_s"],
            **{p: flat[f"{p}_median"] for p in PHASES},
            "step_time": flat["step_time_median"],
            "rss_max": flat["rss_bytes_max"],
            "cuda_max": flat["cuda_bytes_max"],
            "comm_mbps": comm_bytes / comm_time / 1e6 if comm_time > 0 else 0.0,
            "imbalance": flat["imbalance"],
        }
        self._recorded += 1
        if (self._recorded - 1) % self._stride:
            return
        for key, value in point.items():
            text = f"{value:.6g}" if math.isfinite(value) else "null"
            self._series.setdefault(key, []).append(text)
        if len(self._series["step"]) >= _HISTORY:  # keep the whole run at half the resolution
            for values in self._series.values():
                del values[1::2]
            self._stride *= 2

    def _publish(self, *, done: bool) -> None:
        self._published = time.monotonic()
        agg = self.latest
        alerts = self.alerts
        state: dict[str, Any] = {
            "job": self.config.job,
            "world_size": self.world_size,
            "max_steps": self.max_steps,
            "step": agg.step if agg else 0,
            "done": done,
            "updated": time.time(),
            "ranks": [],
            "slowest_rank": None,
            "imbalance": None,
            "alerts": [a.to_dict() for a in alerts.active()] if alerts else [],
            "alert_stats": alerts.statistics() if alerts else {},
            "anomalies": [a.to_dict() for a in list(self.anomalies.found)[-20:]],
        }
        if agg is not None:
            busy = agg.busy
            state["ranks"] = [
                {"rank": r, "busy": busy[r], **{k: row[k] for k in ("step_time", "comm_wait",
                                                                     "tokens_per_s", "rss_bytes")}}
                for r, row in enumerate(agg.ranks)
            ]
            state["slowest_rank"] = agg.slowest_rank
            state["imbalance"] = agg.imbalance
        history = "{" + ",".join(f'"{k}":[{",".join(v)}]' for k, v in self._series.items()) + "}"
        self.dashboard.publish(_finite(state), raw={"history": history})

    # --- end of run ---

    def finish(self) -> dict[str, Any]:
        """Last aggregation (collective), report (printed and written on rank 0), servers closed.

        Returns the report as a dict ({} when monitoring is off); identical on every rank except
        for the ``alerts`` block, which only rank 0 evaluates.
        """
        if not self.on:
            return {}
        if self._window.steps:
            last = (self.history[-1].step if self.history else 0) + self._window.steps
            self._aggregate(last)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._trace is not None:
            path = self._trace.write_merged(self.config.trace)  # collective
            if path is not None:
                self._echo(f"step-phase trace (all ranks, time-aligned): {path}")
        if not self.history:
            self.close()
            return {}
        comm: list[dict[str, Any]] = []
        try:
            from torsh_distributed.comm import profiler

            if profiler.active() is not None:
                comm = profiler.active().summary()  # type: ignore[union-attr]
        except ImportError:
            pass
        cuda_limit = 0.0
        if self.device is not None and self.device.type == "cuda":
            cuda_limit = float(torch.cuda.get_device_properties(self.device).total_memory)
        self.report = build_report(
            self.history,
            memory_limit=memory_limit_bytes(),
            cuda_limit=cuda_limit,
            local_world_size=self.local_world_size,
            anomalies=list(self.anomalies.found),
            alerts=self.alerts.statistics() if self.alerts else {},
            comm=comm,
        )
        data = _finite(self.report.to_dict())
        data["monitor_overhead"] = {  # this rank's own cost, measured (hooks excluded: ~us/step)
            "aggregations": self._aggregations,
            "aggregation_s": self._overhead_s,
            "share_of_step_time": self._overhead_s / self._step_time_s if self._step_time_s else 0.0,
        }
        if self.main:
            self._echo(self.report.format())
            if self.config.report_json:
                path = Path(self.config.report_json)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(json.dumps(data, indent=2) + "\n")
                tmp.replace(path)
            if self.dashboard is not None:
                self._publish(done=True)
        self.close()
        return data

    def close(self) -> None:
        """Stop the servers and notifiers (idempotent)."""
        if not self.on:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        if self.dashboard is not None:
            self.dashboard.close()
            self.dashboard = None
        if self.alerts is not None:
            self.alerts.close()
