"""A SecAgg+ round on Flower's deployment engine, for real: a SuperLink, 5 SuperNodes running
``secagg_client_app``, and a test ServerApp (``_federated_secagg_server.py``) that runs one
:func:`~torsh_distributed.federated.secagg.secagg_round` and records every reply it receives.
One client is SIGKILLed after the ``share_keys`` stage, i.e. after it gave its neighbours shares
of its secrets and before it sent its masked update (the drop SecAgg+ must repair: the others'
masks against it are rebuilt from those shares). One run (about a minute here) serves all tests:

- the round completes with the other 4;
- its aggregate equals the plain FedAvg aggregate of those 4 (their ``train_round`` weights
  averaged by examples, computed here) within the round's stated quantisation bound;
- no array that reached the server equals or is close to any client's plain update, nor looks
  like an unmasked quantised vector.

The in-process tests in tests/unit/test_federated_secagg.py drop a client at every stage.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from torsh_distributed.federated import deploy
from torsh_distributed.federated.client import train_round
from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.deploy import Federation
from torsh_distributed.federated.secagg import DEFAULT_QUANTIZATION_RANGE
from torsh_distributed.federated.task import Task

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
TOY = HERE / "_federated_toy.py"
SERVER = HERE / "_federated_secagg_server.py"
STAGE_TIMEOUT = min(120.0, 15.0 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
"""Seconds each stage waits. The stage after the kill waits this long for the dead client, so it
is short (15 s) on a quiet machine; each stage starts a ClientApp process per client (forked
from a warm forkserver by default, a fresh interpreter importing torch under ``spawn``), so it
grows with the load other work puts on the cores."""

_PYPROJECT = deploy._APP_PYPROJECT.replace(
    'serverapp = "torsh_distributed.federated.apps:server_app"',
    'serverapp = "_federated_secagg_server:server_app"',
).replace(
    'clientapp = "torsh_distributed.federated.apps:client_app"',
    'clientapp = "torsh_distributed.federated.secagg:secagg_client_app"',
)


def _config(run_dir: Path, clients: int) -> FederatedConfig:
    task = TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset")
    client = ClientConfig(local_steps=2, batch_size=4, lr=0.5)
    return FederatedConfig(
        partition="iid", task=task, client=client, clients=clients, run_dir=str(run_dir)
    )


def _prepare(fed: Federation, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> None:
    assert "secagg_client_app" in _PYPROJECT and "_federated_secagg_server" in _PYPROJECT
    monkeypatch.setattr(deploy, "_APP_PYPROJECT", _PYPROJECT)
    app = fed.run_dir / "flwr" / "app"
    app.mkdir(parents=True, exist_ok=True)
    shutil.copy(SERVER, app / SERVER.name)
    (fed.run_dir / "secagg_test.json").write_text(json.dumps(settings))


def _plain_fedavg(
    config: FederatedConfig, partitions: list[int]
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The plain aggregate of these clients (float64) and their plain updates."""
    init = Task(config).model().state_dict()
    results = [train_round(config, init, partition_id=p, server_round=1) for p in partitions]
    total = sum(r.num_examples for r in results)
    mean = {k: sum(r.state[k].double() * r.num_examples for r in results) / total for k in init}
    updates = [{k: r.state[k].double() - init[k].double() for k in init} for r in results]
    return mean, updates


def _assert_within_bound(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: float
) -> None:
    assert 0 < bound < 1e-4
    for name, tensor in want.items():
        # the bound is on the mean update; the new weights are float32 on top of it
        atol = bound + float(tensor.abs().max()) * 2**-24
        err = float((got[name].double() - tensor).abs().max())
        assert err <= atol, f"{name}: error {err:.3g} > bound {atol:.3g}"


def _kill_tree(pid: int) -> None:
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _wait_for(path: Path, timeout: float, running: threading.Thread, lines: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or not running.is_alive():
            raise AssertionError(f"no {path.name}; the run said: {lines}")
        time.sleep(0.1)


@dataclass(frozen=True)
class Round:
    config: FederatedConfig
    state: dict[str, torch.Tensor]
    result: dict[str, Any]
    received: list[dict[str, Any]]
    lines: list[str]


@pytest.fixture(scope="module")
def dropout_round(tmp_path_factory: pytest.TempPathFactory) -> Round:
    run = tmp_path_factory.mktemp("secagg") / "run"
    config = _config(run, clients=5)
    lines: list[str] = []
    fed = Federation(config, echo=lines.append)
    codes: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2")  # start each stage's ClientApp sooner
        # every client shares with all 5; 3 shares rebuild a secret: up to 2 may drop
        _prepare(
            fed, mp, num_shares=0, threshold=3, timeout=STAGE_TIMEOUT, pause_after="share_keys"
        )
        with fed.running():
            thread = threading.Thread(
                target=lambda: codes.append(fed.submit(timeout=280)), daemon=True
            )
            thread.start()
            _wait_for(run / "paused.json", 200, thread, lines)
            assert len(json.loads((run / "paused.json").read_text())) == 5  # all shared their keys
            _kill_tree(fed.procs["supernode-4"].pid)  # it dies before sending its masked update
            (run / "resume").touch()
            thread.join(timeout=280)
    assert codes == [0], lines
    saved = torch.load(run / "secagg_result.pt", weights_only=False)
    received = torch.load(run / "received.pt", weights_only=False)
    return Round(config, saved["state"], saved["result"], received, lines)


def test_round_completes_when_one_of_five_drops_out(dropout_round: Round) -> None:
    result = dropout_round.result
    assert result["failed_stage"] is None, result
    assert result["sampled"] == 5 and result["completed"] == 4 and result["dropped"] == 1
    assert result["active"]["share_keys"] == 5 and result["active"]["collect_masked_vectors"] == 4
    assert sorted(c["partition_id"] for c in result["clients"]) == [0, 1, 2, 3]
    # the dead node went unanswered until the stage's timeout or until the SuperLink declared it
    # unavailable (no heartbeat for 2 intervals), whichever came first
    dead = [e for e in result["errors"] if "Node Unavailable" in e]
    waited = result["stage_seconds"]["collect_masked_vectors"] >= STAGE_TIMEOUT
    assert waited or dead, result
    assert result["bytes"]["up"] > 0 and result["bytes"]["down"] > 0
    # every node answered the start-up probe itself (not with an error: its ClientApp handles it)
    assert result["startup_seconds"] > 0
    assert not [e for e in result["errors"] if "registered" in e or "ClientApp" in e], result
    assert all(c["bytes"] > 0 and c["examples"] > 0 for c in result["clients"])


def test_aggregate_equals_plain_fedavg_within_the_bound(dropout_round: Round) -> None:
    result = dropout_round.result
    assert result["clipped"] == 0
    want, _ = _plain_fedavg(dropout_round.config, [0, 1, 2, 3])
    _assert_within_bound(dropout_round.state, want, result["error_bound"])


def test_server_never_receives_an_unmasked_update(dropout_round: Round) -> None:
    received = dropout_round.received
    want, updates = _plain_fedavg(dropout_round.config, [0, 1, 2, 3, 4])
    masked = [r for r in received if "masked_params" in r["where"]]
    assert len(masked) == 4 * (
        1 + len(want)
    )  # per live client: its weight factor, then each tensor
    assert not [r for r in received if "fitres.parameters" in r["where"]]  # the mod emptied them
    vectors = [r["array"] for r in masked if r["array"].numel() > 1]
    # uniform modulo 2**32, never within the quantised range [0, Q]
    assert all(int(v.max()) > 2 * DEFAULT_QUANTIZATION_RANGE for v in vectors)
    plain = [t for u in updates for t in u.values()] + [t.double() for t in want.values()]
    for array in (r["array"].double() for r in received):
        for reference in plain:
            if array.shape == reference.shape:
                assert not torch.allclose(array, reference, atol=1e-3)
                # nor an unmasked quantised update, (q 2c/Q - c) / a_k with a_k <= 1
                assert not torch.allclose(
                    array * 16 / DEFAULT_QUANTIZATION_RANGE - 8, reference, atol=1e-2
                )
