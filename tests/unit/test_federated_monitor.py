"""A round's record reaches Prometheus (scraped over HTTP) and the dashboard's state."""

from __future__ import annotations

import json
import urllib.request

import pytest

from torsh_distributed.federated.deploy import free_port
from torsh_distributed.federated.monitor import RoundMonitor

RECORD = {
    "round": 2, "loss": 1.25, "accuracy": 0.5, "answered": 2, "dropped": 1, "seconds": 3.5,
    "bytes": {"down": 3000, "up": 1200, "total": 4200}, "epsilon": 2.5,
    "clients": [
        {"partition_id": 0, "loss": 1.5, "seconds": 2.0, "examples": 40, "bytes": 600},
        {"partition_id": 2, "loss": 1.0, "seconds": 3.0, "examples": 60, "bytes": 600},
    ],
}  # fmt: skip


@pytest.mark.timeout(30)
def test_round_metrics_are_scraped_and_shown() -> None:
    metrics, dash = free_port(), free_port()
    monitor = RoundMonitor(job="fl", rounds=5, clients=3, metrics_port=metrics, dashboard_port=dash)
    try:
        monitor.round(RECORD)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert 'torsh_federated_loss{job="fl"} 1.25' in text
        assert 'torsh_federated_clients_dropped{job="fl"} 1.0' in text
        assert 'torsh_federated_bytes{direction="up",job="fl"} 1200.0' in text
        assert 'torsh_federated_epsilon{job="fl"} 2.5' in text
        assert 'torsh_federated_client_seconds{client="2",job="fl"} 3.0' in text
        state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/state", timeout=10).read())
        assert state["unit"] == "round" and state["step"] == 2 and state["max_steps"] == 5
        assert state["history"]["loss"] == [1.25] and state["history"]["tokens_per_s"] == [0.0042]
        assert state["slowest_rank"] == 2 and not state["done"]
    finally:
        monitor.close()


def test_plot_of_rounds_is_a_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from torsh_distributed.federated.report import plot_rounds

    rounds = [dict(RECORD, round=r, loss=2.0 / r, failed=r == 2) for r in (1, 2, 3)]
    path = tmp_path / "fl.png"
    plot_rounds({"strategy": "fedavg", "clients": 3, "rounds": rounds}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    with pytest.raises(ValueError, match="no rounds"):
        plot_rounds({"rounds": []}, str(tmp_path / "none.png"))
