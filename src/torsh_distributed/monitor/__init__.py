"""Observability: per-rank metrics aggregated across ranks, anomaly detection, bottleneck report,
Prometheus exporter, alerting and a live dashboard (see docs/observability.md).

:class:`StepMonitor` is the entry point for any training loop; :class:`MetricsSink` is where its
aggregations go (:class:`JsonlSink`, the Prometheus exporter, the dashboard, or your own).
"""

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
from torsh_distributed.monitor.sinks import JsonlSink, MetricsSink
from torsh_distributed.monitor.step import StepMonitor

__all__ = [
    "Aggregate",
    "AlertManager",
    "Anomaly",
    "AnomalyRule",
    "AnomalyTracker",
    "FIELDS",
    "JsonlSink",
    "LogNotifier",
    "MetricsSink",
    "MonitorConfig",
    "PHASES",
    "RateOfChangeRule",
    "Report",
    "StepMonitor",
    "ThresholdRule",
    "WebhookNotifier",
    "ZScoreDetector",
    "aggregate",
    "build_report",
    "gather",
    "load_alerts",
]
