"""Alert rules (threshold, rate of change, anomaly) with cooldown, acknowledgement, history,
statistics, and the log and webhook notifiers."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from torsh_distributed.monitor.alerts import (
    AlertManager,
    AnomalyRule,
    LogNotifier,
    RateOfChangeRule,
    ThresholdRule,
    WebhookNotifier,
    load_alerts,
)


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def notify(self, event: dict) -> None:
        self.events.append(event)

    def kinds(self) -> list[str]:
        return [e["event"] for e in self.events]


def _manager(rule, *, cooldown_rule=None):
    rec = Recorder()
    return AlertManager([rule], [rec]), rec


def test_threshold_fires_resolves_and_respects_cooldown():
    rule = ThresholdRule(name="slow", metric="step_time_max", op=">", threshold=0.5,
                         severity="critical", cooldown_s=10)
    mgr, rec = _manager(rule)
    assert mgr.evaluate({"step_time_max": 0.4}, now=0) == []
    fired = mgr.evaluate({"step_time_max": 0.7}, step=5, now=1)
    assert [a.rule for a in fired] == ["slow"] and fired[0].severity == "critical"
    assert "step_time_max = 0.7 > 0.5" in fired[0].message
    assert mgr.evaluate({"step_time_max": 0.8}, now=5) == []  # still active, inside cooldown
    assert [a.count for a in mgr.active()] == [2]
    assert mgr.evaluate({"step_time_max": 0.9}, now=12) != []  # cooldown over: reminded
    mgr.evaluate({"step_time_max": 0.1}, now=13)  # resolves
    assert mgr.active() == [] and rec.kinds() == ["firing", "firing", "resolved"]
    mgr.evaluate({"step_time_max": 0.9}, now=14)  # fires again within the cooldown: not notified
    stats = mgr.statistics()
    assert stats["opened"] == 2 and stats["notified"] == 2 and stats["suppressed"] == 2
    assert stats["resolved"] == 1 and stats["active"] == 1 and stats["by_severity"] == {"critical": 2}
    assert len(mgr.history) == 2 and mgr.history[0].resolved == 13


def test_acknowledged_alert_is_silent_until_it_resolves():
    rule = ThresholdRule(name="mem", metric="rss", op=">=", threshold=100, cooldown_s=0)
    mgr, rec = _manager(rule)
    assert not mgr.acknowledge("mem")  # nothing active
    mgr.evaluate({"rss": 100}, now=0)
    assert mgr.acknowledge("mem", by="alice") and not mgr.acknowledge("mem")
    assert mgr.evaluate({"rss": 200}, now=1) == [] and mgr.evaluate({"rss": 300}, now=2) == []
    assert mgr.active()[0].acknowledged_by == "alice"
    mgr.evaluate({"rss": 50}, now=3)
    assert mgr.evaluate({"rss": 150}, now=4) != []  # a new firing notifies again
    assert rec.kinds() == ["firing", "resolved", "firing"]
    assert mgr.statistics()["acknowledged"] == 1


def test_rate_of_change_per_step_and_per_second_with_direction():
    up = RateOfChangeRule(name="loss-up", metric="loss", max_change=0.1, per="step", direction="up",
                          cooldown_s=0)
    mgr, _ = _manager(up)
    assert mgr.evaluate({"loss": 3.0}, step=10, now=0) == []  # first value: no rate yet
    assert mgr.evaluate({"loss": 2.0}, step=20, now=1) == []  # falling is fine for "up"
    fired = mgr.evaluate({"loss": 4.0}, step=30, now=2)  # +0.2 per step
    assert fired and "+0.2/step" in fired[0].message
    per_s = RateOfChangeRule(name="tput", metric="tokens_per_s", max_change=100, per="second",
                             direction="down", cooldown_s=0)
    mgr2, _ = _manager(per_s)
    mgr2.evaluate({"tokens_per_s": 5000}, now=0)
    assert mgr2.evaluate({"tokens_per_s": 4950}, now=1) == []  # -50/s
    assert mgr2.evaluate({"tokens_per_s": 4000}, now=2) != []  # -950/s


def test_anomaly_rule_fires_on_a_spike_only():
    rule = AnomalyRule(name="st", metric="step_time_max", z=3.0, window=20, min_samples=5, cooldown_s=0)
    mgr, rec = _manager(rule)
    for i, v in enumerate([0.10, 0.11, 0.09, 0.10, 0.105, 0.095, 0.10]):
        assert mgr.evaluate({"step_time_max": v}, step=i, now=i) == []
    fired = mgr.evaluate({"step_time_max": 0.5}, step=7, now=7)
    assert fired and "sigma" in fired[0].message
    mgr.evaluate({"step_time_max": 0.1}, step=8, now=8)
    assert rec.kinds() == ["firing", "resolved"]


def test_rules_validate_their_fields():
    with pytest.raises(ValueError, match="severity must be one of info, warning, critical"):
        ThresholdRule(name="x", metric="m", threshold=1, severity="fatal")
    with pytest.raises(ValueError, match="op must be one of"):
        ThresholdRule(name="x", metric="m", threshold=1, op="!=")
    with pytest.raises(ValueError, match="per must be second or step"):
        RateOfChangeRule(name="x", metric="m", max_change=1, per="minute")
    with pytest.raises(ValueError, match="max_change must be > 0"):
        RateOfChangeRule(name="x", metric="m", max_change=0)
    with pytest.raises(ValueError, match="cooldown_s must be >= 0"):
        AnomalyRule(name="x", metric="m", cooldown_s=-1)
    rule = ThresholdRule(name="dup", metric="m", threshold=1)
    with pytest.raises(ValueError, match="names must be unique; repeated: dup"):
        AlertManager([rule, ThresholdRule(name="dup", metric="m", threshold=2)])


def test_log_notifier_logs_and_echoes(caplog):
    lines: list[str] = []
    mgr = AlertManager([ThresholdRule(name="t", metric="m", threshold=1, severity="critical")],
                       [LogNotifier(echo=lines.append)])
    with caplog.at_level(logging.WARNING, logger="torsh_distributed.monitor.alerts"):
        mgr.evaluate({"m": 2}, now=0)
    assert lines == ["[alert firing] critical t: m = 2 > 1"]
    assert caplog.records[0].levelno == logging.ERROR and "critical t" in caplog.text


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_webhook_notifier_posts_json_and_load_alerts_reads_a_file(tmp_path: Path):
    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = {
            "rules": [
                {"type": "threshold", "name": "slow", "metric": "step_time_max", "threshold": 0.5},
                {"type": "rate_of_change", "name": "roc", "metric": "loss", "max_change": 1.0},
                {"type": "anomaly", "name": "an", "metric": "loss", "z": 5},
            ],
            "notifiers": [{"type": "webhook", "url": f"http://127.0.0.1:{server.server_port}/hook"}],
        }
        path = tmp_path / "alerts.json"
        path.write_text(json.dumps(spec))
        mgr = load_alerts(path)
        assert [type(r).__name__ for r in mgr.rules] == ["ThresholdRule", "RateOfChangeRule", "AnomalyRule"]
        mgr.evaluate({"step_time_max": 0.9, "loss": 2.0}, step=3, now=0)
        hook = mgr.notifiers[0]
        assert isinstance(hook, WebhookNotifier) and hook.flush(10)
        assert hook.sent == 1 and _Hook.received[-1]["event"] == "firing"
        assert _Hook.received[-1]["alert"]["rule"] == "slow" and _Hook.received[-1]["alert"]["step"] == 3
        mgr.close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"rules": [{"type": "bogus", "name": "x", "metric": "m"}]}, r"rules\[0\]\.type must be one of"),
        ({"rules": [{"type": "threshold", "name": "x", "metric": "m"}]}, r"rules\[0\] \(threshold\)"),
        ({"rules": [], "notifiers": [{"type": "sms"}]}, r"notifiers\[0\]\.type must be log or webhook"),
        ({"rules": [], "notifiers": [{"type": "webhook", "url": "ftp://x"}]}, "must start with http"),
        ([], "must hold an object with a 'rules' list"),
    ],
)
def test_load_alerts_errors_name_the_entry(tmp_path: Path, spec, match):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=match):
        load_alerts(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_alerts(tmp_path / "missing.json")
