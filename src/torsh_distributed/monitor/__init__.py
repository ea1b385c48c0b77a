"""Observability: per-rank metrics aggregated across ranks, anomaly detection, bottleneck report,
Prometheus exporter, alerting, a live dashboard and experiment tracking (TensorBoard, MLflow; see
docs/observability.md).

:class:`StepMonitor` is the entry point for any training loop; :class:`MetricsSink` is where its
aggregations go (:class:`JsonlSink`, the Prometheus exporter, the dashboard, or your own);
:class:`RunTracker` s (:class:`TensorBoardSink`, :class:`MLflowSink`) also record the run around them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.monitor.alerts import (
        AlertManager,
        AnomalyRule,
        LogNotifier,
        RateOfChangeRule,
        ThresholdRule,
        WebhookNotifier,
        load_alerts,
    )
    from torsh_distributed.monitor.anomaly import Anomaly, AnomalyTracker, ZScoreDetector
    from torsh_distributed.monitor.config import MonitorConfig
    from torsh_distributed.monitor.metrics import FIELDS, PHASES, Aggregate, aggregate, gather
    from torsh_distributed.monitor.report import Report, build_report
    from torsh_distributed.monitor.sinks import JsonlSink, MetricsSink, RunTracker
    from torsh_distributed.monitor.step import StepMonitor
    from torsh_distributed.monitor.tracking import MLflowSink, TensorBoardSink

__all__ = [
    "Aggregate",
    "AlertManager",
    "Anomaly",
    "AnomalyRule",
    "AnomalyTracker",
    "FIELDS",
    "JsonlSink",
    "LogNotifier",
    "MLflowSink",
    "MetricsSink",
    "MonitorConfig",
    "PHASES",
    "RateOfChangeRule",
    "Report",
    "RunTracker",
    "StepMonitor",
    "TensorBoardSink",
    "ThresholdRule",
    "WebhookNotifier",
    "ZScoreDetector",
    "aggregate",
    "build_report",
    "gather",
    "load_alerts",
]

# On first use: the monitor imports torch; the trainer's config needs only monitor.config.
__getattr__, __dir__ = exports(
    __name__,
    {
        "alerts": (
            "AlertManager", "AnomalyRule", "LogNotifier", "RateOfChangeRule", "ThresholdRule",
            "WebhookNotifier", "load_alerts",
        ),
        "anomaly": ("Anomaly", "AnomalyTracker", "ZScoreDetector"),
        "config": ("MonitorConfig",),
        "metrics": ("FIELDS", "PHASES", "Aggregate", "aggregate", "gather"),
        "report": ("Report", "build_report"),
        "sinks": ("JsonlSink", "MetricsSink", "RunTracker"),
        "step": ("StepMonitor",),
        "tracking": ("MLflowSink", "TensorBoardSink"),
    },
)
