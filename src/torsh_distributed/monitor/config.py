"""The trainer's ``monitor`` section: metrics, Prometheus, dashboard, alerts, bottleneck report,
loss-curve plot, experiment tracking (TensorBoard, MLflow)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torsh_distributed.monitor.plot import FORMATS, check_available
from torsh_distributed.monitor.tracking import check_installed

__all__ = ["MonitorConfig"]


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """Observability of a training run; everything is off by default (no cost, no output).

    Any of ``metrics_port``, ``dashboard_port``, ``alerts``, ``report_json``, ``trace``,
    ``tensorboard`` or ``mlflow`` turns monitoring on;
    ``--monitor`` turns it on with only the progress-bar fields and the end-of-run report.
    """

    enabled: bool = field(default=False, metadata={"flags": ["--monitor"], "negatable": True})
    """Collect per-rank step metrics, aggregate them across ranks and print the bottleneck report."""
    every: int = field(default=10, metadata={"flags": ["--monitor-every"]})
    """Aggregate across ranks every N steps (one all_gather of a small tensor); lower = fresher, costlier."""
    metrics_port: int = field(default=0, metadata={"flags": ["--metrics-port"]})
    """Serve Prometheus metrics (all ranks, labelled by job and rank) from rank 0 on this port; 0 = off."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus exporter binds; 0.0.0.0 exposes it to the network (no authentication)."""
    dashboard_port: int = field(default=0, metadata={"flags": ["--dashboard-port"]})
    """Serve the live dashboard from rank 0 on this port; 0 = off."""
    dashboard_host: str = "127.0.0.1"
    """Address the dashboard binds; keep loopback unless the network is trusted (no authentication)."""
    alerts: str = field(default="", metadata={"flags": ["--alerts"]})
    """JSON file of alert rules and notifiers (see docs/observability.md); empty = built-in anomaly rules."""
    report_json: str = field(default="", metadata={"flags": ["--report-json"]})
    """Write the bottleneck/anomaly report as JSON to this file (rank 0); empty = print only."""
    trace: str = field(default="", metadata={"flags": ["--monitor-trace"]})
    """Write one merged, time-aligned Chrome trace of every rank's step phases (plus profiled
    collectives) here at the end (rank 0); empty = no trace. Keeps ~6 tuples per step in memory."""
    plot: str = field(default="", metadata={"flags": ["--plot"]})
    """Write the loss curve (training loss per step, validation points) to this PNG (or .svg,
    .pdf) at the end of the run (rank 0); needs matplotlib (``pip install
    'torsh-distributed[plot]'``). Empty = no plot. Does not turn monitoring on."""
    tensorboard: str = field(default="", metadata={"flags": ["--tensorboard"]})
    """Write TensorBoard event files here (rank 0): every step's loss, learning rate and
    gradient norm, each aggregation's metrics, the parameters and the summary. Needs the
    ``tracking`` extra. Empty = off."""
    mlflow: str = field(default="", metadata={"flags": ["--mlflow"]})
    """Log the run to this MLflow tracking URI (rank 0; ``http://host:5000``,
    ``sqlite:///runs.db``, ...): parameters, the same metrics as ``tensorboard``, the summary
    and artefacts (summary JSON, plot, report). Checked before any rank starts. Needs the
    ``tracking`` extra. Empty = off."""
    experiment: str = field(default="", metadata={"flags": ["--experiment"]})
    """MLflow experiment of the run (created when missing); empty = MLflow's default."""
    run_name: str = field(default="", metadata={"flags": ["--run-name"]})
    """Name of the run: the MLflow run's name, and a subdirectory of ``tensorboard`` (where
    TensorBoard finds runs); empty = MLflow's generated name, events straight into ``tensorboard``."""
    job: str = field(default="torsh", metadata={"flags": ["--metrics-job"]})
    """Value of the ``job`` label on every exported metric."""
    health_interval: float = field(default=1.0, metadata={"flags": ["--health-interval"]})
    """Seconds between heartbeats of every rank of a multi-rank job; rank 0 prints a line naming
    rank, node and host when one goes silent (hung, unreachable) or, with ``--monitor``, lags
    (busy time over 2x the median). 0 = off. Independent of the other monitor options."""
    health_failed_after: float = field(default=10.0, metadata={"flags": ["--health-failed-after"]})
    """Silent heartbeat intervals after which a rank is reported FAILED (degraded after a
    third of them). Raise it when steps or checkpoint saves pause a rank for longer."""
    anomaly_window: int = 50
    """Aggregations kept per metric for the z-score anomaly detector."""
    anomaly_z: float = 4.0
    """|z-score| at or above which an aggregated value counts as an anomaly."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"monitor.every must be >= 1, got {self.every}")
        for name in ("metrics_port", "dashboard_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"monitor.{name} must be 0 (off) or a port in 1..65535, got {port}")
        if self.metrics_port and self.metrics_port == self.dashboard_port:
            raise ValueError(
                f"monitor.metrics_port and monitor.dashboard_port must differ, both are {self.metrics_port}"
            )
        if not self.health_interval >= 0:
            raise ValueError(f"monitor.health_interval must be >= 0 (0 = off), got {self.health_interval}")
        if not self.health_failed_after >= 1:
            raise ValueError(
                f"monitor.health_failed_after must be >= 1 interval, got {self.health_failed_after}"
            )
        if self.anomaly_window < 3:
            raise ValueError(f"monitor.anomaly_window must be >= 3, got {self.anomaly_window}")
        if self.anomaly_z <= 0:
            raise ValueError(f"monitor.anomaly_z must be > 0, got {self.anomaly_z}")
        if not self.job:
            raise ValueError("monitor.job must be a non-empty label value")
        if self.plot:
            if not self.plot.lower().endswith(FORMATS):
                raise ValueError(
                    f"monitor.plot (--plot) must end in {', '.join(FORMATS)}, got {self.plot!r}"
                )
            check_available("monitor.plot (--plot)")  # before any rank starts
        self._check_tracking()

    def _check_tracking(self) -> None:
        if self.tensorboard:
            check_installed("tensorboard", "monitor.tensorboard (--tensorboard)")
        if self.mlflow:
            if not self.mlflow.strip():
                raise ValueError("monitor.mlflow (--mlflow) must be a tracking URI, got only spaces")
            check_installed("mlflow", "monitor.mlflow (--mlflow)")
        if self.experiment and not self.mlflow:
            raise ValueError(
                f"monitor.experiment (--experiment {self.experiment}) names an MLflow experiment: give "
                "--mlflow URI too (TensorBoard has no experiments: use --run-name)"
            )
        if self.run_name and not (self.mlflow or self.tensorboard):
            raise ValueError(
                f"monitor.run_name (--run-name {self.run_name}) names a tracked run: give --tensorboard "
                "DIR or --mlflow URI too"
            )
        if self.run_name and self.tensorboard and ("/" in self.run_name or self.run_name in (".", "..")):
            raise ValueError(
                f"monitor.run_name must be one directory name under --tensorboard, got {self.run_name!r}"
            )

    @property
    def active(self) -> bool:
        """True when any monitoring feature is requested."""
        return bool(
            self.enabled
            or self.metrics_port
            or self.dashboard_port
            or self.alerts
            or self.report_json
            or self.trace
            or self.tensorboard
            or self.mlflow
        )
