"""StepMonitor in a user's own loop (one process): custom metrics, sinks, defaults, bad input."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from torsh_distributed.monitor import (
    FIELDS,
    Aggregate,
    JsonlSink,
    MetricsSink,
    MonitorConfig,
    StepMonitor,
    _dashboard_sink,
    aggregate,
)
from torsh_distributed.monitor.anomaly import Anomaly
from torsh_distributed.testing import find_free_port


class RecordingSink:
    """A user sink: keeps what it is given."""

    def __init__(self) -> None:
        self.updates: list[tuple[Aggregate, dict[str, int], list[Anomaly]]] = []
        self.closed = 0

    def update(self, agg: Aggregate, *, alerts_by_severity: dict[str, int], anomalies: list[Anomaly]) -> None:
        self.updates.append((agg, alerts_by_severity, anomalies))

    def close(self) -> None:
        self.closed += 1


def _steps(mon: StepMonitor, start: int, stop: int, log: dict[int, dict[str, Any]] | None = None) -> None:
    for step in range(start, stop):
        mon.step_begin(step)
        for phase in ("data", "forward", "backward", "optimizer"):
            mon.phase(phase)
        for name, value in (log or {}).get(step, {}).items():
            mon.log(name, value)
        mon.step_end(step + 1, loss=2.0, lr=0.1)


def test_custom_metric_reaches_aggregate_jsonl_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "runs" / "metrics.jsonl"
    mon = StepMonitor(MonitorConfig(enabled=True, every=2), custom_metrics=("accuracy", "unused"),
                      sinks=[JsonlSink(path)])
    values = {0: {"accuracy": 0.5}, 1: {"accuracy": torch.tensor(0.7)}, 2: {"accuracy": 0.9}}
    _steps(mon, 0, 4, values)
    flat = mon.history[0].flat()
    # The rank's window value is the mean of what it logged (0.5, 0.7); one rank: mean = min = max.
    assert flat["custom.accuracy_mean"] == pytest.approx(0.6)
    assert flat["custom.accuracy_min"] == pytest.approx(0.6) and flat["custom.accuracy_max"] == pytest.approx(0.6)
    assert math.isnan(flat["custom.unused_mean"])
    assert mon.latest is not None and mon.latest.ranks[0]["custom.accuracy"] == pytest.approx(0.9)

    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["step"] == 2 and second["step"] == 4
    assert first["custom.accuracy_mean"] == pytest.approx(0.6) and second["custom.accuracy_max"] == pytest.approx(0.9)
    assert first["custom.unused_mean"] is None and "NaN" not in lines[0]  # NaN -> null
    assert first["alerts_by_severity"] == {"info": 0, "warning": 0, "critical": 0}
    assert first["step_time_max"] >= 0 and first["anomalies"] == []

    _steps(mon, 4, 5, {4: {"accuracy": 0.1}})  # a partial window: aggregated by finish()
    report = mon.finish()
    assert len(path.read_text().splitlines()) == 3  # appended, then closed
    assert report["custom"]["accuracy"] == pytest.approx({"last": 0.1, "mean": (0.6 + 0.9 + 0.1) / 3,
                                                          "min": 0.1, "max": 0.9})
    assert report["custom"]["unused"]["last"] is None  # JSON-safe like the rest of the report
    assert "custom metrics" in capsys.readouterr().out


def test_user_sink_receives_every_aggregation_and_is_closed_once():
    sink = RecordingSink()
    assert isinstance(sink, MetricsSink)
    mon = StepMonitor(MonitorConfig(enabled=True, every=3), sinks=[sink])
    _steps(mon, 0, 7)
    assert [agg.step for agg, _, _ in sink.updates] == [3, 6]
    assert sink.updates[0][1] == {"info": 0, "warning": 0, "critical": 0}
    assert sink.closed == 0
    report = mon.finish()
    assert [agg.step for agg, _, _ in sink.updates] == [3, 6, 7] and report["steps"] == 7
    mon.close()  # idempotent: the sink is not closed twice
    assert sink.closed == 1


def test_constructor_defaults_without_a_process_group():
    assert not torch.distributed.is_initialized()
    mon = StepMonitor(MonitorConfig(enabled=True))
    assert (mon.rank, mon.world_size, mon.device, mon.main) == (0, 1, None, True)
    assert mon.local_world_size >= 1
    _steps(mon, 0, 3)
    report = mon.finish()
    assert report["world_size"] == 1 and report["steps"] == 3


def test_loss_and_grad_norm_tensors_are_converted_at_aggregation():
    mon = StepMonitor(MonitorConfig(enabled=True, every=2), rank=0, world_size=1)
    for step in range(2):
        mon.step_begin(step)
        mon.step_end(step + 1, loss=torch.tensor(1.5), lr=0.1, grad_norm=torch.tensor(3.0))
    assert mon.latest is not None
    assert mon.latest.ranks[0]["loss"] == 1.5 and mon.latest.ranks[0]["grad_norm"] == 3.0
    mon.close()


@pytest.mark.parametrize(
    ("names", "match"),
    [
        (("accuracy", "accuracy"), "'accuracy' is declared twice"),
        (("1st",), r"'1st' is not a valid name"),
        (("top-1",), r"'top-1' is not a valid name"),
        (("",), r"'' is not a valid name"),
        ((3,), r"3 is not a valid name"),
    ],
)
def test_bad_custom_metric_names_raise(names: tuple[Any, ...], match: str):
    with pytest.raises(ValueError, match=match):
        StepMonitor(MonitorConfig(enabled=True), custom_metrics=names)


def test_a_string_is_not_a_list_of_names():
    with pytest.raises(TypeError, match="not the string 'accuracy'"):
        StepMonitor(MonitorConfig(enabled=True), custom_metrics="accuracy")  # type: ignore[arg-type]


@pytest.mark.parametrize("enabled", [True, False])
def test_logging_an_undeclared_name_raises_even_when_off(enabled: bool):
    mon = StepMonitor(MonitorConfig(enabled=enabled), custom_metrics=("accuracy",))
    mon.log("accuracy", 1.0)
    with pytest.raises(ValueError, match=r"'acuracy' was not declared \(declared: accuracy\)"):
        mon.log("acuracy", 1.0)
    mon.close()


def test_log_rejects_a_tensor_of_several_values_and_phase_an_unknown_phase():
    mon = StepMonitor(MonitorConfig(enabled=True), custom_metrics=("accuracy",))
    with pytest.raises(ValueError, match=r"'accuracy': expected one value, got a tensor of shape \(2,\)"):
        mon.log("accuracy", torch.ones(2))
    mon.step_begin(0)
    with pytest.raises(ValueError, match=r"phase must be one of data, forward, .*, got 'loss'"):
        mon.phase("loss")
    mon.close()


def test_bad_sinks_ranks_and_ignored_sinks():
    with pytest.raises(TypeError, match=r"sinks\[1\] \(object\) is not a MetricsSink"):
        StepMonitor(MonitorConfig(enabled=True), sinks=[RecordingSink(), object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        StepMonitor(MonitorConfig(enabled=True), rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        StepMonitor(MonitorConfig(enabled=True), rank=0, world_size=0)
    with pytest.warns(UserWarning, match=r"1 sink\(s\) ignored, monitoring is off"):
        off = StepMonitor(MonitorConfig(), sinks=[RecordingSink()])
    assert off.finish() == {}


def test_prometheus_exports_custom_metrics_as_one_gauge_with_a_name_label():
    pytest.importorskip("prometheus_client")
    from torsh_distributed.monitor.prometheus import PrometheusExporter

    def agg(rank1: float) -> Aggregate:
        rows = []
        for rank, value in enumerate((0.5, rank1)):
            base = dict.fromkeys(FIELDS, 0.0)
            base.update(step=4, step_time=0.1 + rank * 0.01)
            rows.append([base[f] for f in FIELDS] + [value])
        return aggregate(rows, custom=("accuracy",))

    exporter = PrometheusExporter(job="unit")
    anomaly = Anomaly("loss", 4, 9.0, 2.0, 0.1, 70.0)
    exporter.update(agg(0.75), alerts_by_severity={}, anomalies=[anomaly])
    text = exporter.text()
    assert 'torsh_custom{job="unit",name="accuracy",rank="1"} 0.75' in text
    assert 'torsh_anomalies_total{job="unit",metric="loss"} 1.0' in text
    exporter.update(agg(math.nan), alerts_by_severity={}, anomalies=[])  # rank 1 logged nothing
    text = exporter.text()
    assert 'rank="1"} 0.75' not in text and 'torsh_custom{job="unit",name="accuracy",rank="0"} 0.5' in text
    assert isinstance(exporter, MetricsSink)
    exporter.close()


def test_energy_metrics_get_gauges_of_their_own_and_the_dashboard_sums_the_ranks(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("prometheus_client")
    from torsh_distributed.energy.tracker import METRICS
    from torsh_distributed.monitor.prometheus import PrometheusExporter

    rows = []
    for joules, watts, grams in ((30.0, 12.5, 0.004), (40.0, math.nan, 0.006)):
        base = dict.fromkeys(FIELDS, 0.0)
        base.update(step=4, step_time=0.1)
        rows.append([base[f] for f in FIELDS] + [joules, watts, grams, 0.25])
    agg = aggregate(rows, custom=(*METRICS, "accuracy"))
    exporter = PrometheusExporter(job="unit")
    exporter.update(agg, alerts_by_severity={}, anomalies=[])
    text = exporter.text()
    assert 'torsh_energy_joules{job="unit",rank="1"} 40.0' in text
    assert 'torsh_power_watts{job="unit",rank="0"} 12.5' in text and 'torsh_power_watts{job="unit",rank="1"}' not in text
    assert 'torsh_carbon_grams{job="unit",rank="0"} 0.004' in text
    assert 'name="energy' not in text and 'torsh_custom{job="unit",name="accuracy",rank="0"} 0.25' in text
    exporter.close()
    monkeypatch.setattr(_dashboard_sink, "_PUBLISH_EVERY_S", 0.0)
    port = find_free_port()
    mon = StepMonitor(MonitorConfig(dashboard_port=port, every=2), custom_metrics=METRICS, max_steps=4,
                      echo=lambda _text: None)
    _steps(mon, 0, 2, {1: {"energy_joules": 30.0, "energy_w": 12.5, "carbon_grams": 0.01}})
    state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=5).read())
    mon.finish()
    assert state["history"]["power_w"] == [12.5] and state["history"]["carbon_g"] == [0.01]


def test_dashboard_sink_publishes_state_and_applies_acks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_dashboard_sink, "_PUBLISH_EVERY_S", 0.0)
    rules = {"rules": [{"type": "threshold", "name": "low-accuracy", "metric": "custom.accuracy_mean",
                        "op": "<", "threshold": 0.5, "cooldown_s": 0}]}
    (tmp_path / "alerts.json").write_text(json.dumps(rules))
    port = find_free_port()
    sink = RecordingSink()
    mon = StepMonitor(MonitorConfig(dashboard_port=port, every=2, alerts=str(tmp_path / "alerts.json")),
                      custom_metrics=("accuracy",), sinks=[sink], max_steps=6, echo=lambda _text: None)
    url = f"http://127.0.0.1:{port}/"
    _steps(mon, 0, 2, {0: {"accuracy": 0.2}})
    state = json.loads(urllib.request.urlopen(url + "api/state", timeout=5).read())
    assert state["step"] == 2 and state["max_steps"] == 6 and not state["done"]
    assert state["history"]["step"] == [2] and [a["rule"] for a in state["alerts"]] == ["low-accuracy"]
    assert sink.updates[-1][1]["warning"] == 1  # the user sink sees the alert counts
    request = urllib.request.Request(url + "api/ack?rule=low-accuracy", method="POST")
    assert urllib.request.urlopen(request, timeout=5).status == 202
    _steps(mon, 2, 4, {2: {"accuracy": 0.3}})
    assert mon.alerts is not None
    (alert,) = mon.alerts.active()
    assert alert.acknowledged and alert.acknowledged_by == "dashboard"
    mon.finish()
    assert sink.closed == 1
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "api/state", timeout=2)


def test_custom_stats_are_mean_min_max_over_the_ranks_that_logged():
    rows = []
    for value in (1.0, 2.0, 6.0, math.nan):  # rank 3 logged nothing this window
        base = dict.fromkeys(FIELDS, 0.0)
        base.update(step=8, step_time=0.1)
        rows.append([base[f] for f in FIELDS] + [value])
    flat = aggregate(rows, custom=("accuracy",)).flat()
    assert (flat["custom.accuracy_mean"], flat["custom.accuracy_min"], flat["custom.accuracy_max"]) == (3.0, 1.0, 6.0)
    with pytest.raises(ValueError, match=rf"expected rows of {len(FIELDS)} \+ 1 custom fields"):
        aggregate([row[:-1] for row in rows], custom=("accuracy",))
