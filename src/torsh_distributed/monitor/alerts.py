"""Alerting: threshold, rate-of-change and anomaly rules; severity, cooldown, acknowledgement,
history and statistics; notifiers for the log and for a webhook.

Rules see the flat metrics of each aggregation (:meth:`Aggregate.flat`: ``step_time_max``,
``loss``, ``tokens_per_s``, ``imbalance``, ``comm_share``, ``rss_bytes_max``...). A rule that
holds opens an *active* alert and notifies; it notifies again at most once per ``cooldown_s``
while it keeps holding, and never again once acknowledged; when the rule stops holding the alert
resolves (and a later firing within the cooldown is recorded but not notified).
"""

from __future__ import annotations

import abc
import json
import logging
import math
import queue
import threading
import time
import urllib.request
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torsh_distributed.monitor.anomaly import ZScoreDetector

__all__ = [
    "SEVERITIES",
    "Alert",
    "Rule",
    "ThresholdRule",
    "RateOfChangeRule",
    "AnomalyRule",
    "Notifier",
    "LogNotifier",
    "WebhookNotifier",
    "AlertManager",
    "load_alerts",
    "default_rules",
]

SEVERITIES = ("info", "warning", "critical")
_log = logging.getLogger("torsh_distributed.monitor.alerts")


@dataclass(kw_only=True, slots=True)
class Rule(abc.ABC):
    """Common fields of every rule; subclasses implement :meth:`check`."""

    name: str
    """Unique name; used to acknowledge the alert."""
    metric: str
    """Flat metric the rule watches (``step_time_max``, ``loss``, ``imbalance``...)."""
    severity: str = "warning"
    """``info``, ``warning`` or ``critical``."""
    cooldown_s: float = 60.0
    """Minimum seconds between two notifications of this rule."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("alert rule name must be non-empty")
        if self.severity not in SEVERITIES:
            raise ValueError(
                f"alert rule {self.name!r}: severity must be one of {', '.join(SEVERITIES)}, "
                f"got {self.severity!r}"
            )
        if self.cooldown_s < 0:
            raise ValueError(f"alert rule {self.name!r}: cooldown_s must be >= 0, got {self.cooldown_s}")

    @abc.abstractmethod
    def check(self, value: float, *, now: float, step: int) -> str | None:
        """A message when the rule holds for ``value``, else ``None``."""


_OPS = {">": float.__gt__, ">=": float.__ge__, "<": float.__lt__, "<=": float.__le__}


@dataclass(kw_only=True, slots=True)
class ThresholdRule(Rule):
    """Holds while ``value <op> threshold``."""

    op: str = ">"
    """One of ``>``, ``>=``, ``<``, ``<=``."""
    threshold: float
    """The bound."""

    def __post_init__(self) -> None:
        Rule.__post_init__(self)
        if self.op not in _OPS:
            raise ValueError(f"alert rule {self.name!r}: op must be one of {', '.join(_OPS)}, got {self.op!r}")

    def check(self, value: float, *, now: float, step: int) -> str | None:
        if value == value and _OPS[self.op](float(value), float(self.threshold)):
            return f"{self.metric} = {value:.4g} {self.op} {self.threshold:.4g}"
        return None


@dataclass(kw_only=True, slots=True)
class RateOfChangeRule(Rule):
    """Holds when the change since the previous value exceeds ``max_change`` per ``per``."""

    max_change: float
    """Largest allowed change (absolute units of the metric) per ``per``."""
    per: str = "second"
    """``second`` (rate over wall time) or ``step`` (rate over training steps)."""
    direction: str = "both"
    """``up``, ``down`` or ``both``: which sign of change counts."""
    _prev: tuple[float, float, int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        Rule.__post_init__(self)
        if self.max_change <= 0:
            raise ValueError(f"alert rule {self.name!r}: max_change must be > 0, got {self.max_change}")
        if self.per not in ("second", "step"):
            raise ValueError(f"alert rule {self.name!r}: per must be second or step, got {self.per!r}")
        if self.direction not in ("up", "down", "both"):
            raise ValueError(
                f"alert rule {self.name!r}: direction must be up, down or both, got {self.direction!r}"
            )

    def check(self, value: float, *, now: float, step: int) -> str | None:
        prev, self._prev = self._prev, (value, now, step)
        if prev is None or not (value == value and prev[0] == prev[0]):
            return None
        span = (now - prev[1]) if self.per == "second" else float(step - prev[2])
        if span <= 0:
            return None
        rate = (value - prev[0]) / span
        signed = {"up": rate, "down": -rate, "both": abs(rate)}[self.direction]
        if signed > self.max_change:
            return f"{self.metric} changed {rate:+.4g}/{self.per} (limit {self.max_change:.4g}/{self.per})"
        return None


@dataclass(kw_only=True, slots=True)
class AnomalyRule(Rule):
    """Holds when the value's z-score against its recent window reaches ``z``."""

    z: float = 4.0
    """|z| that fires."""
    window: int = 50
    """Values in the baseline window."""
    min_samples: int = 8
    """Values needed before the rule can fire."""
    _detector: ZScoreDetector | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        Rule.__post_init__(self)
        self._detector = ZScoreDetector(
            window=self.window, threshold=self.z, min_samples=min(self.min_samples, self.window)
        )

    def check(self, value: float, *, now: float, step: int) -> str | None:
        assert self._detector is not None
        anomaly = self._detector.update(value, metric=self.metric, step=step)
        return anomaly.describe() if anomaly is not None else None


@dataclass(slots=True)
class Alert:
    """One firing of a rule, from open to resolved."""

    rule: str
    metric: str
    severity: str
    message: str
    value: float
    step: int
    started: float
    """Wall time (``time.time()``) the alert opened."""
    last_value: float = math.nan
    count: int = 1
    """Evaluations during which the rule held."""
    acknowledged: bool = False
    acknowledged_by: str = ""
    resolved: float | None = None
    notified: bool = False
    """Whether a firing notification went out (only then is the resolution notified)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule, "metric": self.metric, "severity": self.severity,
            "message": self.message, "value": _json_num(self.value), "step": self.step,
            "started": self.started, "count": self.count, "acknowledged": self.acknowledged,
            "acknowledged_by": self.acknowledged_by, "resolved": self.resolved,
        }


def _json_num(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Notifier(Protocol):
    """Receives alert events: ``{"event": "firing"|"resolved", "alert": {...}}``."""

    def notify(self, event: dict[str, Any]) -> None: ...


class LogNotifier:
    """Logs every event (``logging``, logger ``torsh_distributed.monitor.alerts``) and optionally prints."""

    def __init__(self, *, echo: Any = None) -> None:
        self._echo = echo

    def notify(self, event: dict[str, Any]) -> None:
        alert = event["alert"]
        text = f"[alert {event['event']}] {alert['severity']} {alert['rule']}: {alert['message']}"
        level = logging.ERROR if alert["severity"] == "critical" else logging.WARNING
        _log.log(level if event["event"] == "firing" else logging.INFO, text)
        if self._echo is not None:
            self._echo(text)


class WebhookNotifier:
    """POSTs each event as JSON to ``url`` from a background thread (training never waits on it).

    Args:
        url: ``http://`` or ``https://`` endpoint.
        timeout_s: Per request; failures are logged and dropped, never raised into training.
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook url must start with http:// or https://, got {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.sent = 0
        self.failed = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="torsh-webhook", daemon=True)
        self._thread.start()

    def notify(self, event: dict[str, Any]) -> None:
        self._queue.put(event)

    def _run(self) -> None:
        while (event := self._queue.get()) is not None:
            request = urllib.request.Request(
                self.url, data=json.dumps(event).encode(), method="POST",
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
                    response.read()
                self.sent += 1
            except OSError as exc:
                self.failed += 1
                _log.warning("alert webhook %s failed: %s", self.url, exc)
            finally:
                self._queue.task_done()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued events are sent (or ``timeout_s`` passes); True if all were."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        self.flush()
        self._queue.put(None)


class AlertManager:
    """Evaluates rules, tracks active alerts, and keeps history and statistics.

    Args:
        rules: Rules with unique names.
        notifiers: Receive ``firing`` and ``resolved`` events.
        max_history: Closed and open alerts remembered (oldest dropped first).
    """

    def __init__(self, rules: list[Rule], notifiers: list[Notifier] | None = None, *,
                 max_history: int = 500) -> None:
        names = [r.name for r in rules]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"alert rule names must be unique; repeated: {', '.join(dupes)}")
        self.rules = list(rules)
        self.notifiers = list(notifiers or [])
        self.history: deque[Alert] = deque(maxlen=max_history)
        self._active: dict[str, Alert] = {}
        self._last_notified: dict[str, float] = {}
        self._stats: Counter[str] = Counter()
        self._by_rule: Counter[str] = Counter()
        self._by_severity: Counter[str] = Counter()

    def evaluate(self, values: dict[str, float], *, step: int = 0, now: float | None = None) -> list[Alert]:
        """Apply every rule to ``values``; return the alerts notified as firing now."""
        now = time.time() if now is None else now
        fired = []
        for rule in self.rules:
            if rule.metric not in values:
                continue
            value = values[rule.metric]
            message = rule.check(value, now=now, step=step)
            alert = self._active.get(rule.name)
            if message is None:
                if alert is not None:
                    self._resolve(alert, now)
                continue
            if alert is None:
                alert = Alert(rule.name, rule.metric, rule.severity, message, value, step, now, value)
                self._active[rule.name] = alert
                self.history.append(alert)
                self._stats["opened"] += 1
                self._by_rule[rule.name] += 1
                self._by_severity[rule.severity] += 1
            else:
                alert.count += 1
                alert.last_value = value
                alert.message = message
                if alert.acknowledged:
                    continue
            if now - self._last_notified.get(rule.name, -math.inf) >= rule.cooldown_s:
                self._last_notified[rule.name] = now
                self._stats["notified"] += 1
                alert.notified = True
                self._send("firing", alert)
                fired.append(alert)
            else:
                self._stats["suppressed"] += 1
        return fired

    def _resolve(self, alert: Alert, now: float) -> None:
        alert.resolved = now
        del self._active[alert.rule]
        self._stats["resolved"] += 1
        if alert.notified:  # a firing suppressed by the cooldown resolves silently
            self._send("resolved", alert)

    def _send(self, kind: str, alert: Alert) -> None:
        event = {"event": kind, "alert": alert.to_dict()}
        for notifier in self.notifiers:
            try:
                notifier.notify(event)
            except Exception as exc:  # a broken notifier must not stop training
                _log.warning("alert notifier %r failed: %s", notifier, exc)

    def acknowledge(self, rule: str, *, by: str = "") -> bool:
        """Silence the active alert of ``rule`` until it resolves; False if none is active."""
        alert = self._active.get(rule)
        if alert is None or alert.acknowledged:
            return False
        alert.acknowledged = True
        alert.acknowledged_by = by
        self._stats["acknowledged"] += 1
        return True

    def active(self) -> list[Alert]:
        """Open alerts, most severe first."""
        order = {s: i for i, s in enumerate(reversed(SEVERITIES))}
        return sorted(self._active.values(), key=lambda a: (order[a.severity], a.started))

    def statistics(self) -> dict[str, Any]:
        """Counts: opened, notified, suppressed (cooldown), acknowledged, resolved, active; by rule and severity."""
        keys = ("opened", "notified", "suppressed", "acknowledged", "resolved")
        return {
            **{k: self._stats[k] for k in keys},
            "active": len(self._active),
            "by_rule": dict(self._by_rule),
            "by_severity": dict(self._by_severity),
        }

    def close(self) -> None:
        for notifier in self.notifiers:
            close = getattr(notifier, "close", None)
            if close is not None:
                close()


_RULE_TYPES: dict[str, type[Rule]] = {
    "threshold": ThresholdRule,
    "rate_of_change": RateOfChangeRule,
    "anomaly": AnomalyRule,
}


def default_rules() -> list[Rule]:
    """Rules used without ``--alerts``: anomalies of the slowest step time and of the loss."""
    return [
        AnomalyRule(name="step-time-anomaly", metric="step_time_max", severity="warning", z=4.0),
        AnomalyRule(name="loss-anomaly", metric="loss", severity="warning", z=4.0),
    ]


def load_alerts(path: str | Path, *, echo: Any = None) -> AlertManager:
    """An :class:`AlertManager` from a JSON file ``{"rules": [...], "notifiers": [...]}``.

    Each rule is ``{"type": "threshold"|"rate_of_change"|"anomaly", "name": ..., "metric": ...}``
    plus that type's fields; notifiers are ``{"type": "log"}`` or ``{"type": "webhook", "url": ...}``
    (default: the log only).
    """
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"monitor.alerts: cannot read {path}: {exc}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("rules"), list):
        raise ValueError(f"monitor.alerts: {path} must hold an object with a 'rules' list")
    rules = []
    for i, raw in enumerate(spec["rules"]):
        raw = dict(raw)
        kind = raw.pop("type", None)
        if kind not in _RULE_TYPES:
            raise ValueError(
                f"monitor.alerts: rules[{i}].type must be one of {', '.join(_RULE_TYPES)}, got {kind!r}"
            )
        try:
            rules.append(_RULE_TYPES[kind](**raw))
        except TypeError as exc:
            raise ValueError(f"monitor.alerts: rules[{i}] ({kind}): {exc}") from None
    notifiers: list[Notifier] = []
    for i, raw in enumerate(spec.get("notifiers") or [{"type": "log"}]):
        kind = raw.get("type")
        if kind == "log":
            notifiers.append(LogNotifier(echo=echo))
        elif kind == "webhook":
            notifiers.append(WebhookNotifier(raw.get("url", ""), timeout_s=float(raw.get("timeout_s", 5.0))))
        else:
            raise ValueError(f"monitor.alerts: notifiers[{i}].type must be log or webhook, got {kind!r}")
    return AlertManager(rules, notifiers)
