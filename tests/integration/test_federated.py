"""Federated rounds on Flower's deployment engine, for real: a SuperLink and SuperNode processes
on loopback, clients training with the engine.

(FedAvg's parity through Flower runs on network-namespace hosts in test_federated_multihost.py.)
- A client SIGKILLed mid-round: the round closes at its deadline with the other; then the server
  (SuperLink and ServerApp) SIGKILLed: a rerun resumes after the last saved round and reports
  the round that was lost.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.deploy import Federation

pytestmark = pytest.mark.timeout(240)

TOY = Path(__file__).with_name("_federated_toy.py")


def _config(run_dir: Path, **kw: object) -> FederatedConfig:
    task = TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset", val_dataset=f"{TOY}:dataset")
    client = kw.pop("client", ClientConfig(local_steps=1, batch_size=16, lr=0.5))
    return FederatedConfig(
        partition="iid", task=task, client=client, run_dir=str(run_dir), **kw  # type: ignore[arg-type]
    )


def _kill_tree(proc: psutil.Process) -> None:
    victims = [proc, *proc.children(recursive=True)]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_dead_client_then_dead_server(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = _config(run, clients=2, rounds=2, min_clients=1, round_timeout=20.0)
    fed = Federation(config, echo=lambda _: None)
    codes: list[int] = []
    with fed.running():
        thread = threading.Thread(target=lambda: codes.append(fed.submit(timeout=180)), daemon=True)
        thread.start()
        node_log = run / "logs" / "supernode-1.log"
        _wait_for(lambda: node_log.exists() and "Start `flwr-clientapp`" in node_log.read_text(), 90,
                  "client 1 to start its round")
        _kill_tree(psutil.Process(fed.procs["supernode-1"].pid))  # the client dies mid-round
        ckpt = run / "server" / "round_00001" / "state.json"
        _wait_for(ckpt.exists, 90, "round 1 to close at its deadline")
        started = run / "server" / "started.json"
        _wait_for(lambda: '"round": 2' in started.read_text(), 60, "round 2 to begin")
        _kill_tree(psutil.Process(fed.procs["superlink"].pid))  # the server dies in round 2
        thread.join(timeout=60)
    import json

    first = json.loads(ckpt.read_text())["rounds"][0]
    assert first["answered"] == 1 and first["dropped"] == 1 and not first["failed"]
    assert first["seconds"] >= 20.0  # it waited for the dead client until the deadline
    assert not (run / "summary.json").exists()

    lines: list[str] = []
    again = Federation(config, echo=lines.append)
    with again.running():
        assert again.submit(timeout=180) == 0, lines
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_round"] == 1 and summary["rounds_lost"] == 1
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    assert summary["rounds"][1]["answered"] == 2
    assert any("resuming after round 1" in line for line in lines)
