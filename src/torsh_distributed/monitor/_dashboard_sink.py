"""The live dashboard as a metrics sink: keeps the chart series and publishes the page's state.

Built by :class:`~torsh_distributed.monitor.step.StepMonitor` on rank 0 when
``monitor.dashboard_port`` is set. Besides the aggregations it reads the monitor's alert manager
(active alerts, statistics, acknowledgements from the page) and anomaly tracker.
"""

from __future__ import annotations

import math
import time
from typing import Any

from torsh_distributed.monitor.alerts import AlertManager
from torsh_distributed.monitor.anomaly import Anomaly, AnomalyTracker
from torsh_distributed.monitor.metrics import CUSTOM_PREFIX, PHASES, Aggregate
from torsh_distributed.monitor.server import DashboardServer
from torsh_distributed.monitor.sinks import json_safe

__all__ = ["DashboardSink"]

_HISTORY = 500  # dashboard points per series; when full, every other point is dropped
_PUBLISH_EVERY_S = 1.0  # the page polls once a second; serialising the history costs ~ms


class DashboardSink:
    """Serves the dashboard and feeds it each aggregation (published at most once a second).

    Args:
        host: Bind address of the dashboard server.
        port: Its port (0 = any free port).
        job: Job name shown on the page.
        world_size: Ranks in the job.
        max_steps: Shown as the run's length (0 = unknown).
        alerts: The monitor's alert manager (its active alerts and statistics are shown, and the
            page's acknowledgements applied to it).
        anomalies: The monitor's anomaly tracker (the last 20 anomalies are shown).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        job: str,
        world_size: int,
        max_steps: int,
        alerts: AlertManager,
        anomalies: AnomalyTracker,
    ) -> None:
        server = DashboardServer(host=host, port=port)  # OSError naming the flag when taken
        self._server: DashboardServer | None = server
        self.url = server.url
        self._job, self._world_size, self._max_steps = job, world_size, max_steps
        self._alerts, self._anomalies = alerts, anomalies
        self._latest: Aggregate | None = None
        self._series: dict[str, list[str]] = {}  # JSON text of each point, formatted once
        self._stride = 1  # record every _stride-th aggregation (doubles when the history is full)
        self._recorded = 0
        self._published = 0.0
        self._publish(done=False)

    def apply_acks(self) -> None:
        """Acknowledge the alerts the page asked for (before the monitor evaluates the rules)."""
        if self._server is None:
            return
        for rule in self._server.pending_acks():
            self._alerts.acknowledge(rule, by="dashboard")

    def update(self, agg: Aggregate, *, alerts_by_severity: dict[str, int], anomalies: list[Anomaly]) -> None:
        """Record the chart point of ``agg``; publish if the last publication is a second old."""
        self._latest = agg
        self._record_series(agg, agg.flat())
        if time.monotonic() - self._published >= _PUBLISH_EVERY_S:
            self._publish(done=False)

    def close(self) -> None:
        """Publish the final state ("finished") and stop the server (idempotent)."""
        if self._server is None:
            return
        self._publish(done=True)
        self._server.close()
        self._server = None

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
        if "energy_w" in agg.custom:  # the energy tracker's metrics: the job's power and carbon
            point["power_w"] = _sum_finite(agg.column(CUSTOM_PREFIX + "energy_w"))
            point["carbon_g"] = _sum_finite(agg.column(CUSTOM_PREFIX + "carbon_grams"))
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
        if self._server is None:
            return
        self._published = time.monotonic()
        agg = self._latest
        alerts = self._alerts
        state: dict[str, Any] = {
            "job": self._job,
            "world_size": self._world_size,
            "max_steps": self._max_steps,
            "step": agg.step if agg else 0,
            "done": done,
            "updated": time.time(),
            "ranks": [],
            "slowest_rank": None,
            "imbalance": None,
            "alerts": [a.to_dict() for a in alerts.active()],
            "alert_stats": alerts.statistics(),
            "anomalies": [a.to_dict() for a in list(self._anomalies.found)[-20:]],
        }
        if agg is not None:
            busy = agg.busy
            keys = ("step_time", "comm_wait", "tokens_per_s", "rss_bytes")
            state["ranks"] = [
                {"rank": r, "busy": busy[r], **{k: row[k] for k in keys}} for r, row in enumerate(agg.ranks)
            ]
            state["slowest_rank"] = agg.slowest_rank
            state["imbalance"] = agg.imbalance
        history = "{" + ",".join(f'"{k}":[{",".join(v)}]' for k, v in self._series.items()) + "}"
        self._server.publish(json_safe(state), raw={"history": history})


def _sum_finite(values: list[float]) -> float:
    """The sum of the ranks that logged in the window (NaN when none did)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) if finite else math.nan
