"""Observability: per-rank metrics aggregated across ranks, anomaly detection, bottleneck report,
Prometheus exporter, alerting and a live dashboard (see docs/observability.md)."""

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
from torsh_distributed.monitor.trainer import TrainerMonitor

__all__ = [
    "Aggregate",
    "AlertManager",
    "Anomaly",
    "AnomalyRule",
    "AnomalyTracker",
    "FIELDS",
    "LogNotifier",
    "MonitorConfig",
    "PHASES",
    "RateOfChangeRule",
    "Report",
    "ThresholdRule",
    "TrainerMonitor",
    "WebhookNotifier",
    "ZScoreDetector",
    "aggregate",
    "build_report",
    "gather",
    "load_alerts",
]
