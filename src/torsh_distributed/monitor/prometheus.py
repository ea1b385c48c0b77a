"""Prometheus exporter: every rank's aggregated metrics, served by rank 0, labelled job and rank.

Rank 0 holds the gathered matrix of every aggregation, so one endpoint exposes the whole job
(one scrape target, no per-rank ports to configure). Metrics use a private registry, so several
exporters can coexist in one process (tests) and nothing from other libraries leaks in.

Prometheus attaches its own ``job`` label from the scrape config; set ``honor_labels: true`` on
the scrape job to keep ours (otherwise ours is renamed ``exported_job``).

Custom metrics (``StepMonitor.log``) share one gauge, ``torsh_custom{job, rank, name}``: a label
keeps the user's name as written (no sanitising, no clash with our metric names) and one Grafana
query (``torsh_custom{name="accuracy"}``) covers any of them.

The exporter is a :class:`~torsh_distributed.monitor.sinks.MetricsSink`: the step monitor builds
it from ``monitor.metrics_port`` and calls :meth:`update` at each aggregation.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from torsh_distributed.monitor.anomaly import Anomaly
from torsh_distributed.monitor.metrics import CUSTOM_PREFIX, PHASES, Aggregate

__all__ = ["PrometheusExporter", "available"]


def available() -> bool:
    """True when ``prometheus_client`` is installed (the ``monitor`` extra)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class PrometheusExporter:
    """Gauges per rank, updated at each aggregation, served over HTTP on ``host:port``.

    Args:
        job: Value of the ``job`` label.
        host: Bind address; loopback by default (the endpoint has no authentication).
        port: TCP port; 0 = do not serve (useful to render :meth:`text` in tests).
    """

    def __init__(self, *, job: str, host: str = "127.0.0.1", port: int = 0) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge
        except ImportError:
            raise ImportError(
                "monitor.metrics_port needs prometheus_client: pip install 'torsh-distributed[monitor]'"
            ) from None
        self.job = job
        self.registry = CollectorRegistry()
        r, ranked, jobbed = self.registry, ["job", "rank"], ["job"]

        def gauge(name: str, doc: str, labels: list[str] = ranked) -> Any:
            return Gauge(name, doc, labels, registry=r)

        self.step_time = gauge("torsh_step_time_seconds", "Mean step time per rank over the last window.")
        self.phase = gauge("torsh_step_phase_seconds", "Mean seconds per step in each phase.",
                           ["job", "rank", "phase"])
        self.samples = gauge("torsh_samples_per_second", "Samples per second of this rank.")
        self.tokens = gauge("torsh_tokens_per_second", "Tokens per second of this rank.")
        self.rss = gauge("torsh_memory_rss_bytes", "Resident set size of the rank's process.")
        self.cuda = gauge("torsh_memory_cuda_bytes", "CUDA memory allocated by the rank (0 on CPU).")
        self.loss = gauge("torsh_loss", "Training loss (last step of the window).")
        self.grad_norm = gauge("torsh_grad_norm", "Global gradient norm before clipping.")
        self.lr = gauge("torsh_learning_rate", "Learning rate.")
        self.comm_bytes = gauge("torsh_comm_bytes_per_step", "Bytes of profiled collectives per step.")
        self.comm_time = gauge("torsh_comm_seconds_per_step", "Seconds in profiled collectives per step.")
        self.step = gauge("torsh_step", "Last optimizer step of the window.")
        self.slowest = gauge("torsh_slowest_rank", "Rank with the largest busy time.", jobbed)
        self.imbalance = gauge("torsh_imbalance_ratio", "Busy time of the slowest rank over the median.", jobbed)
        self.total_tokens = gauge("torsh_job_tokens_per_second", "Tokens per second, all ranks.", jobbed)
        self.alerts = gauge("torsh_alerts_active", "Active alerts by severity.", ["job", "severity"])
        self.custom = gauge("torsh_custom", "Custom metric logged by the training loop (window mean "
                            "of the rank).", ["job", "rank", "name"])
        self.energy = {  # the energy tracker's custom metrics, each on a gauge of its own
            "energy_joules": gauge("torsh_energy_joules", "Joules of the rank's meter since the run's first "
                                   "step (GPU: NVML; host: RAPL, shared by the host's ranks; else estimated)."),
            "energy_w": gauge("torsh_power_watts", "Average watts of the rank's meter between its last two readings."),
            "carbon_grams": gauge("torsh_carbon_grams", "Grams CO2e of the rank's joules at the grid intensity."),
        }
        self.anomalies = Counter("torsh_anomalies", "Anomalies detected.", ["job", "metric"], registry=r)
        self._server: Any = None
        self.port = port
        if port:
            from prometheus_client import start_http_server

            try:
                self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
            except OSError as exc:
                raise OSError(
                    exc.errno, f"cannot serve Prometheus metrics on {host}:{port} ({exc.strerror}); "
                    "choose another --metrics-port"
                ) from exc

    def update(
        self,
        agg: Aggregate,
        *,
        alerts_by_severity: dict[str, int] | None = None,
        anomalies: list[Anomaly] | None = None,
    ) -> None:
        """Set every gauge from one aggregation and count its new anomalies.

        A custom metric a rank did not log in the window (NaN) has its series removed rather
        than left at a stale value.
        """
        job = self.job
        for rank, row in enumerate(agg.ranks):
            labels = (job, str(rank))
            self.step_time.labels(*labels).set(row["step_time"])
            for phase in PHASES:
                self.phase.labels(job, str(rank), phase).set(row[phase])
            self.samples.labels(*labels).set(row["samples_per_s"])
            self.tokens.labels(*labels).set(row["tokens_per_s"])
            self.rss.labels(*labels).set(row["rss_bytes"])
            self.cuda.labels(*labels).set(row["cuda_bytes"])
            for gauge, key in ((self.loss, "loss"), (self.grad_norm, "grad_norm"), (self.lr, "lr")):
                if math.isfinite(row[key]):
                    gauge.labels(*labels).set(row[key])
            self.comm_bytes.labels(*labels).set(row["comm_bytes"])
            self.comm_time.labels(*labels).set(row["comm_time"])
            self.step.labels(*labels).set(row["step"])
            for name in agg.custom:
                value = row[CUSTOM_PREFIX + name]
                own = self.energy.get(name)
                if own is not None:
                    if math.isfinite(value):
                        own.labels(*labels).set(value)
                elif math.isfinite(value):
                    self.custom.labels(job, str(rank), name).set(value)
                else:
                    with contextlib.suppress(KeyError):  # KeyError: never set
                        self.custom.remove(job, str(rank), name)
        self.slowest.labels(job).set(agg.slowest_rank)
        self.imbalance.labels(job).set(agg.imbalance)
        self.total_tokens.labels(job).set(agg.tokens_per_s)
        for severity in ("info", "warning", "critical"):
            self.alerts.labels(job, severity).set((alerts_by_severity or {}).get(severity, 0))
        for anomaly in anomalies or ():
            self.count_anomaly(anomaly.metric)

    def count_anomaly(self, metric: str) -> None:
        self.anomalies.labels(self.job, metric).inc()

    def text(self) -> str:
        """The exposition text a scrape would return."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def close(self) -> None:
        """Stop serving (frees the port)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
