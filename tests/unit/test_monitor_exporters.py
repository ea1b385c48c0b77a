"""Prometheus exposition, the dashboard server's routes, the monitor config, and the off switch."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from torsh_distributed.monitor import FIELDS, MonitorConfig, StepMonitor, aggregate
from torsh_distributed.monitor.server import DashboardServer
from torsh_distributed.testing import find_free_port


def _agg(grad_norm: float = float("nan"), *, energy: bool = False):
    rows = []
    for rank in range(2):
        base = dict.fromkeys(FIELDS, 0.0)
        base.update(step=20, step_time=0.1 + rank * 0.05, comm_wait=0.01, loss=2.5, lr=1e-3,
                    grad_norm=grad_norm, tokens_per_s=500.0)
        rows.append([base[f] for f in FIELDS] + ([100.0, 50.0, 0.01] if energy else []))
    return aggregate(rows, custom=("energy_joules", "energy_w", "carbon_grams") if energy else ())


def test_prometheus_text_has_job_and_rank_labels_and_serves_http():
    pytest.importorskip("prometheus_client")
    from torsh_distributed.monitor.prometheus import PrometheusExporter

    port = find_free_port()
    exporter = PrometheusExporter(job="unit", port=port)
    try:
        exporter.update(_agg(), alerts_by_severity={"warning": 2})
        exporter.count_anomaly("loss")
        text = exporter.text()
        assert 'torsh_step_time_seconds{job="unit",rank="1"} 0.15' in text
        assert 'torsh_step_phase_seconds{job="unit",phase="comm_wait",rank="0"} 0.01' in text
        assert 'torsh_slowest_rank{job="unit"} 1.0' in text
        assert 'torsh_alerts_active{job="unit",severity="warning"} 2.0' in text
        assert 'torsh_anomalies_total{job="unit",metric="loss"} 1.0' in text
        assert "torsh_grad_norm{" not in text  # NaN values are not exported
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'torsh_loss{job="unit",rank="0"} 2.5' in scraped
    finally:
        exporter.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_dashboard_serves_page_assets_state_and_queues_acks():
    server = DashboardServer(port=0)
    try:
        server.publish({"step": 3, "history": {"loss": [1.0]}})
        page = urllib.request.urlopen(server.url, timeout=5).read().decode()
        assert '<canvas id="chart-loss"' in page and "https://" not in page
        js = urllib.request.urlopen(server.url + "app.js", timeout=5).read().decode()
        assert "api/state" in js and "http" not in js.replace("api/", "")
        state = json.loads(urllib.request.urlopen(server.url + "api/state", timeout=5).read())
        assert state == {"step": 3, "history": {"loss": [1.0]}}
        request = urllib.request.Request(server.url + "api/ack?rule=slow", method="POST")
        assert urllib.request.urlopen(request, timeout=5).status == 202
        assert server.pending_acks() == ["slow"] and server.pending_acks() == []
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(server.url + "../config.py", timeout=5)
        with pytest.raises(ValueError, match="Out of range float"):
            server.publish({"x": float("nan")})  # the dashboard sink cleans NaN first
    finally:
        server.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, "monitor.every must be >= 1"),
        ({"metrics_port": 70000}, r"monitor.metrics_port must be 0 \(off\) or a port"),
        ({"metrics_port": 9000, "dashboard_port": 9000}, "must differ"),
        ({"anomaly_window": 2}, "monitor.anomaly_window must be >= 3"),
        ({"job": ""}, "monitor.job must be a non-empty"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MonitorConfig(**kwargs)


def test_config_active_and_trainer_flags():
    assert not MonitorConfig().active
    assert MonitorConfig(report_json="r.json").active and MonitorConfig(enabled=True).active
    import argparse

    from torsh_distributed.cli.train import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--metrics-port", "9100", "--dashboard-port", "8050", "--alerts",
                              "a.json", "--report-json", "r.json", "--monitor-every", "5"])
    cfg = config_from_args(args).monitor
    assert (cfg.metrics_port, cfg.dashboard_port, cfg.alerts, cfg.report_json, cfg.every) == (
        9100, 8050, "a.json", "r.json", 5)


def test_disabled_monitor_is_a_no_op():
    mon = StepMonitor(MonitorConfig(), rank=0, world_size=1)
    mon.step_begin(0)
    mon.phase("data")
    mon.step_end(1, loss=1.0, lr=0.1)
    assert mon.postfix() == {} and mon.finish() == {} and not mon.on


def test_enabled_monitor_single_rank_report(capsys):
    mon = StepMonitor(MonitorConfig(enabled=True, every=2), rank=0, world_size=1,
                         samples_per_step=4, tokens_per_step=256)
    for step in range(6):
        mon.step_begin(step)
        for phase in ("data", "forward", "backward", "optimizer"):
            mon.phase(phase)
        mon.step_end(step + 1, loss=2.0, lr=0.1)
    assert "slowest" in mon.postfix() and len(mon.history) == 3
    report = mon.finish()
    assert report["steps"] == 6 and report["world_size"] == 1 and report["slowest_rank"] == 0
    assert "bottleneck report (steps 1-6, 1 ranks)" in capsys.readouterr().out


def test_grafana_dashboard_uses_only_exported_metrics():
    pytest.importorskip("prometheus_client")
    import re
    from pathlib import Path

    import torsh_distributed.monitor as monitor
    from torsh_distributed.monitor.prometheus import PrometheusExporter

    exporter = PrometheusExporter(job="g")
    exporter.update(_agg(grad_norm=1.0, energy=True))  # the energy tracker's metrics too
    exporter.count_anomaly("loss")
    exported = set(re.findall(r"^(torsh_\w+?)(?:\{| )", exporter.text(), re.M))
    board = json.loads((Path(monitor.__file__).parent / "grafana" / "torsh.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\btorsh_\w+", e)}
    assert used and used <= exported, used - exported
    assert {"torsh_step_time_seconds", "torsh_slowest_rank", "torsh_step_phase_seconds", "torsh_power_watts"} <= used


def test_taken_ports_fail_with_the_flag_to_change():
    pytest.importorskip("prometheus_client")
    from torsh_distributed.monitor.prometheus import PrometheusExporter

    server = DashboardServer(port=0)
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{server.port}.*choose another --metrics-port"):
            PrometheusExporter(job="x", port=server.port)
        with pytest.raises(OSError, match="choose another --dashboard-port"):
            DashboardServer(port=server.port)
    finally:
        server.close()
