"""Your own Flower strategy and client-side evaluation, for real on Flower's deployment engine:
a trimmed mean written here runs 3 rounds of 3 clients and each round's global model equals this
test's own computation (the clients' updates recomputed with ``train_round``, trimmed here);
each round's client-side evaluation gives every client's loss on its own data, equal to this
test's evaluation of that round's model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torsh_distributed.federated.client import train_round
from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.deploy import Federation
from torsh_distributed.federated.task import Task, evaluate

# generous: every client's train and evaluate message starts a ClientApp process (forked from a
# warm forkserver; a fresh interpreter importing torch under spawn); a round took 15 s quiet and
# ~50 s beside a 2-rank training job and other tests before ClientApps were forked
pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).parent
TOY = HERE / "_federated_toy.py"
STRATEGIES = HERE / "_federated_strategies.py"


def _config(run_dir: Path, strategy: str) -> FederatedConfig:
    task = TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset")
    return FederatedConfig(
        partition="iid", task=task, client=ClientConfig(local_steps=2, batch_size=8, lr=0.5),
        clients=3, rounds=3, strategy=strategy, fraction_evaluate=1.0, run_dir=str(run_dir),
    )


def test_user_trimmed_mean_runs_three_rounds_with_client_evaluation(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(HERE))
    from _federated_strategies import trimmed

    config = _config(tmp_path / "run", f"{STRATEGIES}:trimmed_mean")
    lines: list[str] = []
    fed = Federation(config, echo=lines.append)
    with fed.running():
        assert fed.submit(timeout=600) == 0, lines
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]

    task = Task(config)
    model, loss = task.model(), task.loss()
    state = model.state_dict()
    shares = [task.client_data(p).dataset for p in range(3)]
    for record in summary["rounds"]:
        r = record["round"]
        results = [train_round(config, state, partition_id=p, server_round=r) for p in range(3)]
        state = trimmed([res.state for res in results], 1)  # the median of 3 clients
        model.load_state_dict(state)
        want = [evaluate(model, share, loss, seed=config.seed)["loss"] for share in shares]
        ev = record["evaluate"]
        assert (ev["sampled"], ev["answered"]) == (3, 3), record
        assert [c["partition_id"] for c in ev["clients"]] == [0, 1, 2]
        assert [c["loss"] for c in ev["clients"]] == pytest.approx(want, rel=1e-6, abs=1e-7)
        weights = [c["examples"] for c in ev["clients"]]
        mean = sum(w * x for w, x in zip(weights, want, strict=True)) / sum(weights)
        assert ev["loss"] == pytest.approx(mean, rel=1e-6)  # Flower's weighted mean, by the strategy
        assert "client eval loss" in "\n".join(lines)
    saved = torch.load(tmp_path / "run" / "server" / "round_00003" / "model.pt", weights_only=True)
    for name, tensor in state.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_factory_that_returns_no_strategy_is_refused_before_any_process(tmp_path: Path) -> None:
    from torsh_distributed.federated.strategies import build_strategy

    config = _config(tmp_path / "run", f"{STRATEGIES}:not_a_strategy")
    with pytest.raises(ValueError, match="returned object, not a Flower Strategy"):
        build_strategy(config)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="secagg does not combine with strategy"):
        FederatedConfig(strategy=f"{STRATEGIES}:trimmed_mean", secagg=True, clients=3)


def test_own_flower_app_drives_the_engine_client_app(tmp_path: Path) -> None:
    """examples/flower_app: the user's ServerApp (Flower's FedAvg.start) with the engine's
    ClientApp, through `torsh-dist federated --app`: 2 rounds, both clients train and evaluate,
    and the clients' evaluation loss falls."""
    from torsh_distributed.testing.cli import run_cli

    app = HERE.parents[1] / "examples" / "flower_app"
    result = tmp_path / "result.json"
    cli = ["federated", "--clients", "2", "--run-dir", str(tmp_path / "run"), "--timeout", "500",
           "--app", str(app), "--app-config", f'num-server-rounds=2 result="{result}"']
    done = run_cli(cli, timeout=560)  # a warm process (torsh_distributed.testing.cli)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads(result.read_text())
    assert sorted(metrics["train"]) == sorted(metrics["evaluate"]) == ["1", "2"]
    assert metrics["evaluate"]["2"]["loss"] < metrics["evaluate"]["1"]["loss"]
    assert "flower_app: round 2 train loss" in done.stdout
