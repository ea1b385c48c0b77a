"""The step monitor: hooks any training loop calls, cheap no-ops when monitoring is off.

The loop calls, per step::

    monitor.step_begin(step)
    ... sample the batch ...          monitor.phase("data")
    ... forward ...                   monitor.phase("forward")
    ... backward ...                  monitor.phase("backward")
    ... clip + optimizer step ...     monitor.phase("optimizer")
    ... loss all-reduce ...           monitor.step_end(step + 1, loss=..., lr=..., grad_norm=...)

and :meth:`StepMonitor.finish` once at the end (collective). ``comm_wait`` is communication
that did not overlap compute: the tail of backward after the last gradient was accumulated (DDP
waiting for its all-reduce) plus the end-of-step loss all-reduce. Values of the user's own
(:meth:`StepMonitor.log`) ride in the same all-gather as the timings.

In a user's loop, after ``torsh_distributed.init()`` (or any ``torch.distributed`` process
group)::

    monitor = StepMonitor(MonitorConfig(enabled=True, every=10), custom_metrics=("accuracy",),
                          sinks=[JsonlSink("runs/metrics.jsonl")])
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from torsh_distributed.monitor import alerts as A
from torsh_distributed.monitor._step_setup import check_names, default_device, health_watch
from torsh_distributed.monitor._trackers import TrackerSet
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
from torsh_distributed.monitor.sinks import MetricsSink, RunTracker, json_safe
from torsh_distributed.monitor.trace import PhaseTrace
from torsh_distributed.runtime import world

__all__ = ["StepMonitor", "SLOW_RANK_ENV"]

SLOW_RANK_ENV = "TORSH_MONITOR_TEST_SLOW_RANK"
"""Test hook: ``RANK:SECONDS`` makes that rank sleep SECONDS in the data phase of every step."""

_ANOMALY_METRICS = ("step_time_max", "loss", "tokens_per_s", "grad_norm_median")
class StepMonitor:
    """Per-rank step timings, cross-rank aggregation, alerts, sinks and the end-of-run report.

    Every rank constructs one with the same config and ``custom_metrics``; the aggregation steps
    of :meth:`step_end` and :meth:`finish` are collective (one ``all_gather`` of a small float64
    tensor on the default process group). Rank 0 evaluates the alert rules, feeds the sinks and
    prints the report.

    Args:
        config: The ``monitor`` section; when nothing in it is enabled every method returns at
            once (``log`` still checks its name, so a typo fails with monitoring off too).
        rank: This rank; default: the default process group's rank (0 without one).
        world_size: Ranks in the job; default: the process group's size (1 without one).
        local_world_size: Ranks on this node (they share its memory, which the report's memory
            rule needs); default: the launcher's ``LOCAL_WORLD_SIZE`` or equivalent (1 without).
        device: Device of the aggregation tensor; default: the process group's device (this
            rank's CUDA device under NCCL, else CPU). It must be one the group can all-gather on.
        max_steps: Shown on the dashboard (0 = unknown).
        samples_per_step: Samples this rank processes per step (0 = no samples/s).
        tokens_per_step: Tokens this rank processes per step (0 = no tokens/s).
        params: Parameters whose gradient accumulation marks the end of backward compute; without
            them ``backward`` includes DDP's wait for its all-reduce (nothing is ``comm_wait``).
        custom_metrics: Names :meth:`log` accepts (letters, digits, ``_``). Declaring them up front
            gives every rank the same gather layout, so a name one rank never logs costs nothing
            and cannot desynchronise the collective; the monitor checks at its first aggregation
            that every rank declared the same names (ValueError on every rank otherwise).
        sinks: Extra :class:`~torsh_distributed.monitor.sinks.MetricsSink` s fed on rank 0 after
            the built-in ones (Prometheus exporter, dashboard, TensorBoard, MLflow); the monitor
            closes them at the end. A :class:`~torsh_distributed.monitor.sinks.RunTracker`
            among them is started here on rank 0 and also gets every step's loss, learning rate
            and gradient norm, the ``track_*`` calls and the report at :meth:`finish`.
            Ignored, with a warning, when monitoring is off.
        echo: Prints a line on rank 0 (a progress bar's ``write``); ``print`` by default.
    """

    def __init__(
        self,
        config: MonitorConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        local_world_size: int | None = None,
        device: torch.device | None = None,
        max_steps: int = 0,
        samples_per_step: int = 0,
        tokens_per_step: int = 0,
        params: Iterable[torch.Tensor] = (),
        custom_metrics: Sequence[str] = (),
        sinks: Sequence[MetricsSink] = (),
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.on = config.active
        self.report: Report | None = None
        self.custom_metrics = check_names(custom_metrics)
        self._custom_index = {name: i for i, name in enumerate(self.custom_metrics)}
        for i, sink in enumerate(sinks):
            if not isinstance(sink, MetricsSink):
                raise TypeError(
                    f"sinks[{i}] ({type(sink).__name__}) is not a MetricsSink: it needs "
                    "update(agg, *, alerts_by_severity, anomalies) and close()"
                )
        self.health = health_watch(config, rank=rank, world_size=world_size, echo=echo)
        self._comm_wait_s: float | None = None  # of the last step, for the health watch
        if not self.on:
            if sinks:
                warnings.warn(
                    f"StepMonitor: {len(sinks)} sink(s) ignored, monitoring is off (set "
                    "MonitorConfig(enabled=True) or another monitor option)",
                    stacklevel=2,
                )
            return
        self.rank = world.rank() if rank is None else rank
        self.world_size = world.world_size() if world_size is None else world_size
        self.local_world_size = world.local_world_size() if local_world_size is None else local_world_size
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        self.main = self.rank == 0
        self.device = default_device() if device is None else device
        self.max_steps = max_steps
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self._echo: Callable[[str], None] = echo or (lambda text: print(text, flush=True))
        self._window = WindowStats()
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._custom_sum: list[Any] = [0.0] * len(self.custom_metrics)  # floats or 0-d tensors
        self._custom_count = [0] * len(self.custom_metrics)
        self._layout_checked = False
        self._grad_norm_given = False  # in this window
        self._t0 = self._last = self._grad_t = 0.0
        self.history: list[Aggregate] = []
        self.latest: Aggregate | None = None
        self.anomalies = AnomalyTracker(
            _ANOMALY_METRICS, window=config.anomaly_window, threshold=config.anomaly_z
        )
        self._slow = self._parse_slow()
        self._trace = PhaseTrace() if config.trace else None
        self._step = 0
        self._first_step: int | None = None
        self._prof_seen = 0
        self._overhead_s = 0.0  # time in aggregations (collective, alerts, sinks)
        self._aggregations = 0
        self._step_time_s = 0.0
        self._hooks: list[Any] = []
        for p in params:
            if not p.requires_grad:
                continue
            try:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_done))
            except RuntimeError:  # a parameter type without the hook: backward includes the wait
                break
        self.alerts: A.AlertManager | None = None
        self._dashboard: Any = None
        self.sinks: list[MetricsSink] = []
        self._tracking: TrackerSet | None = None  # rank 0 with trackers
        if self.main:
            self.alerts = (
                A.load_alerts(config.alerts, echo=self._echo)
                if config.alerts
                else A.AlertManager(A.default_rules(), [A.LogNotifier(echo=self._echo)])
            )
            self._build_sinks()
        self.sinks.extend(sinks)
        if self.main:
            self._start_trackers()

    def _build_sinks(self) -> None:
        config = self.config
        try:
            if config.metrics_port:
                from torsh_distributed.monitor.prometheus import PrometheusExporter

                exporter = PrometheusExporter(
                    job=config.job, host=config.metrics_host, port=config.metrics_port
                )  # OSError naming the address when the port is taken
                self.sinks.append(exporter)
                self._echo(f"prometheus metrics: http://{config.metrics_host}:{config.metrics_port}/metrics")
            if config.dashboard_port:
                from torsh_distributed.monitor._dashboard_sink import DashboardSink

                assert self.alerts is not None
                self._dashboard = DashboardSink(
                    host=config.dashboard_host, port=config.dashboard_port, job=config.job,
                    world_size=self.world_size, max_steps=self.max_steps, alerts=self.alerts,
                    anomalies=self.anomalies,
                )
                self.sinks.append(self._dashboard)
                self._echo(f"live dashboard: {self._dashboard.url}")
            if config.tensorboard or config.mlflow:
                from torsh_distributed.monitor.tracking import build_trackers

                self.sinks.extend(build_trackers(config))
        except BaseException:
            self.close()  # the exporter's port, when the dashboard's failed
            raise

    def _start_trackers(self) -> None:
        """Rank 0: open every tracker's run now, so a bad location fails before training."""
        trackers = [sink for sink in self.sinks if isinstance(sink, RunTracker)]
        if not trackers:
            return
        self._tracking = TrackerSet(trackers)
        try:
            self._tracking.start()
        except BaseException:
            self.close(failed=True)
            raise

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
        """Start timing step ``step`` (0-based)."""
        if not self.on:
            return
        self._t0 = self._last = time.perf_counter()
        self._step = step + 1
        if self._first_step is None:
            self._first_step = step + 1
        if self._slow:
            time.sleep(self._slow)

    def phase(self, name: str) -> None:
        """Close phase ``name`` (one of data, forward, backward, optimizer, comm_wait) at this instant."""
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
            try:
                self._phases[name] += now - self._last
            except KeyError:  # costs nothing on the happy path
                raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {name!r}") from None
            if self._trace is not None:
                self._trace.add(self._step, name, self._last, now)
        self._last = now

    def log(self, name: str, value: float | torch.Tensor) -> None:
        """Record a value of custom metric ``name`` on this rank; any rank, any time in a step.

        A rank's value for the window is the mean of what it logged since the last aggregation;
        the aggregation then gives the mean, min and max over the ranks that logged it
        (``custom.<name>_mean`` / ``_min`` / ``_max`` in :meth:`Aggregate.flat`). A 0-d tensor is
        kept as is and converted at the aggregation (no device sync per step). A value logged
        after the ``step_end`` of an aggregation step counts in the next window.

        Raises:
            ValueError: ``name`` was not declared in ``custom_metrics``.
        """
        index = self._custom_index.get(name)
        if index is None:
            declared = ", ".join(self.custom_metrics) or "none"
            raise ValueError(
                f"custom metric {name!r} was not declared (declared: {declared}); pass "
                f"custom_metrics=(..., {name!r}) to StepMonitor on every rank"
            )
        if not self.on:
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"custom metric {name!r}: expected one value, got a tensor of shape "
                                 f"{tuple(value.shape)}")
            value = value.detach().reshape(())
        else:
            value = float(value)
        self._custom_sum[index] = self._custom_sum[index] + value
        self._custom_count[index] += 1

    def step_end(
        self, step: int, *, loss: float | torch.Tensor, lr: float, grad_norm: float | torch.Tensor | None = None
    ) -> None:
        """Close the step (the rest counts as ``comm_wait``); aggregate every ``config.every`` steps.

        ``step`` is the number of steps done (1-based); collective on aggregation steps. ``loss``
        and ``grad_norm`` may be 0-d tensors: they are converted at the aggregation.
        """
        if not self.on:
            if self.health is not None:
                self.health.step_end(step)
            return
        now = time.perf_counter()
        self._phases["comm_wait"] += now - self._last
        if self.health is not None:
            self.health.step_end(step, comm_wait_s=self._phases["comm_wait"])
        if self._trace is not None:
            self._trace.add(step, "comm_wait", self._last, now)
        w = self._window
        self._step_time_s += now - self._t0
        w.add_step(now - self._t0, self._phases, samples=self.samples_per_step, tokens=self.tokens_per_step)
        self._phases = dict.fromkeys(PHASES, 0.0)
        w.loss, w.lr = loss, lr  # a loss tensor is converted at aggregation (no sync per step)
        if grad_norm is not None:
            w.grad_norm = grad_norm
            self._grad_norm_given = True
        if self._tracking is not None:  # rank 0: converted at the aggregation
            self._tracking.record(step, loss, lr, grad_norm)
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

    def _check_layout(self) -> None:
        """Once, before the first gather: every rank declared the same custom metrics.

        Rows of different lengths would make the all-gather fail or hang; comparing a fixed-size
        fingerprint first lets every rank raise the same error instead.
        """
        self._layout_checked = True
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        names = "\0".join(self.custom_metrics).encode()
        mine = torch.tensor([len(self.custom_metrics), zlib.crc32(names)], dtype=torch.float64,
                            device=self.device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        prints = [tuple(p.tolist()) for p in parts]
        differ = [r for r, p in enumerate(prints) if p != prints[0]]
        if differ:
            raise ValueError(
                f"StepMonitor custom_metrics differ across ranks: ranks {differ} declared other names "
                f"than rank 0 (rank {self.rank} declared {self.custom_metrics}); pass the same "
                "custom_metrics on every rank"
            )

    def _custom_row(self) -> list[float]:
        row = [
            float(total) / count if count else float("nan")
            for total, count in zip(self._custom_sum, self._custom_count, strict=True)
        ]
        self._custom_sum = [0.0] * len(self.custom_metrics)
        self._custom_count = [0] * len(self.custom_metrics)
        return row

    def _aggregate(self, step: int) -> None:
        start = time.perf_counter()
        self._aggregate_now(step)
        self._overhead_s += time.perf_counter() - start
        self._aggregations += 1

    def _aggregate_now(self, step: int) -> None:
        if not self._layout_checked:
            self._check_layout()
        w = self._window
        w.comm_bytes, w.comm_time = self._comm_window()
        w.grad_norm, w.loss, w.lr = float(w.grad_norm), float(w.loss), float(w.lr)
        cuda = 0.0
        if self.device is not None and self.device.type == "cuda":
            cuda = float(torch.cuda.memory_allocated(self.device))
        row = w.row(step=step, rss=rss_bytes(), cuda=cuda) + self._custom_row()
        agg = gather(row, device=self.device, custom=self.custom_metrics)
        self._window = WindowStats()
        self.latest = agg
        self.history.append(agg)
        flat = agg.flat()
        # A loop that never passes grad_norm has NaN there, which the detector would flag at
        # every aggregation; NaN from a passed grad_norm is a real anomaly.
        watched = flat if self._grad_norm_given else {k: v for k, v in flat.items() if k != "grad_norm_median"}
        self._grad_norm_given = False
        found = self.anomalies.update(watched, step=step)
        if not self.main:
            return
        assert self.alerts is not None
        if self._dashboard is not None:
            self._dashboard.apply_acks()
        self.alerts.evaluate(flat, step=step)
        severities = dict.fromkeys(A.SEVERITIES, 0)
        for alert in self.alerts.active():
            severities[alert.severity] += 1
        if self._tracking is not None:
            self._tracking.flush()  # every step's loss, before the aggregation's metrics
        for sink in self.sinks:
            sink.update(agg, alerts_by_severity=dict(severities), anomalies=list(found))

    # --- experiment tracking (rank 0; no-ops elsewhere and without trackers) ---

    def track_params(self, params: Mapping[str, Any]) -> None:
        """Hand the run's parameters (nested mappings allowed) to the trackers; call once."""
        if self.on and self._tracking is not None:
            self._tracking.params(params)

    def track_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Hand scalars of ``step`` (a validation loss, ...) to the trackers now; any rank may
        call it, rank 0's values are recorded."""
        if self.on and self._tracking is not None:
            self._tracking.metrics(metrics, step=step)

    def track_summary(
        self, summary: Mapping[str, Any], *, step: int, name: str = "summary", artifacts: Sequence[str] = ()
    ) -> None:
        """Hand the run's summary and files to keep with it to the trackers (see
        :meth:`RunTracker.log_summary <torsh_distributed.monitor.sinks.RunTracker.log_summary>`)."""
        if self.on and self._tracking is not None:
            self._tracking.summary(summary, step=step, name=name, artifacts=artifacts)

    # --- end of run ---

    def finish(self, *, close: bool = True) -> dict[str, Any]:
        """Last aggregation (collective), report (printed and written on rank 0), sinks closed.

        Returns the report as a dict ({} when monitoring is off); identical on every rank except
        for the ``alerts`` block, which only rank 0 evaluates, and ``monitor_overhead``. Custom
        metrics are under ``custom``.

        Args:
            close: Hand the report to the trackers as their summary (``report.json``, with the
                report and trace files) and close every sink. ``False`` leaves the sinks open for
                a caller that has a summary of its own to track (the engine's carries this
                report under ``monitor``), then calls :meth:`close`.
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
            if close:
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
            first_step=self._first_step or 1,
        )
        data = json_safe(self.report.to_dict())
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
        if close:
            files = [f for f in (self.config.report_json, self.config.trace) if f]
            self.track_summary(data, step=self.history[-1].step, name="report", artifacts=files)
            self.close()
        return data

    def close(self, *, failed: bool = False) -> None:
        """Close the sinks (the dashboard publishes its final state first; trackers flush and
        end their run, as failed when ``failed``: pass ``True`` from an error path), stop the
        alert notifiers, remove the gradient hooks, stop the health watch (idempotent;
        :meth:`finish` calls it)."""
        if self.health is not None:
            self.health.stop()
        if not self.on:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        sinks, self.sinks, self._dashboard = self.sinks, [], None
        tracking, self._tracking = self._tracking, None
        errors: list[Exception] = []
        if tracking is not None:
            try:
                tracking.flush()  # the steps since the last aggregation (a run that raised)
            except Exception as exc:
                errors.append(exc)
        for sink in sinks:  # every sink gets closed even when one fails
            try:
                if failed and tracking is not None and tracking.owns(sink):
                    cast(RunTracker, sink).close(failed=True)
                else:
                    sink.close()
            except Exception as exc:
                errors.append(exc)
        if self.alerts is not None:
            self.alerts.close()
        if errors:
            raise errors[0]
