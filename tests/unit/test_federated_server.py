"""The federated server's pieces in one process, with Flower's real strategies and DP wrapper:
FedAvg of 4 clients equals centralized SGD, the DP noise and epsilon, compressed updates, the
server checkpoint, config errors. (A stand-in grid only lists node ids for Flower's sampling.)"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from torsh_distributed.federated.client import straggler_steps, train_round
from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.hooks import FederatedHooks
from torsh_distributed.federated.privacy import PrivacyConfig
from torsh_distributed.federated.server import ServerCheckpoint, ServerState
from torsh_distributed.federated.strategies import (
    build_strategy,
    load_strategy_state,
    strategy_state,
)
from torsh_distributed.federated.task import Task
from torsh_distributed.federated.updates import UpdateCodec

TOY = Path(__file__).parents[1] / "integration" / "_federated_toy.py"
sys.path.insert(0, str(TOY.parent))

from _federated_toy import centralized_sgd_step  # noqa: E402


class _Nodes:
    """What Flower's sampling asks of a grid: the connected node ids."""

    def __init__(self, count: int) -> None:
        self.ids = list(range(100, 100 + count))

    def get_node_ids(self) -> list[int]:
        return self.ids


@pytest.fixture(autouse=True)
def _identity() -> None:
    TaskIdentity.run_id = 1  # Messages are stamped with the run of the process
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 1


def _replies(messages: list[Message], states: list[dict[str, torch.Tensor]], weights: list[float]) -> list[Message]:
    return [
        Message(
            content=RecordDict({"arrays": ArrayRecord(s), "metrics": MetricRecord({"weight": w, "num-examples": int(w)})}),
            reply_to=m,
        )
        for m, s, w in zip(messages, states, weights, strict=True)
    ]


def _toy(**kw: object) -> FederatedConfig:
    task = TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset")
    return FederatedConfig(partition="iid", task=task, **kw)  # type: ignore[arg-type]


def test_fedavg_of_four_clients_equals_centralized_sgd() -> None:
    config = _toy(clients=4, min_clients=4, client=ClientConfig(local_steps=1, batch_size=8, lr=0.3))
    task = Task(config)
    initial = task.model().state_dict()
    strategy = build_strategy(config)
    messages = list(strategy.configure_train(1, ArrayRecord(initial), ConfigRecord({}), _Nodes(4)))
    results = [train_round(config, initial, partition_id=i, server_round=1) for i in range(4)]
    replies = _replies(messages, [r.state for r in results], [r.num_examples for r in results])
    merged, _ = strategy.aggregate_train(1, replies)

    got = merged.to_torch_state_dict()
    for name, tensor in centralized_sgd_step(0.3).items():  # one step on the union (32 items)
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)


def test_dp_noise_has_the_stated_std_and_epsilon_matches_the_accountant() -> None:
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    z, delta = 1.0, 1e-5
    config = _toy(clients=4, fraction=0.5, min_clients=2, privacy=PrivacyConfig(noise_multiplier=z, delta=delta))
    hooks = FederatedHooks(config)
    strategy = hooks.wrap_strategy(build_strategy(config))
    zeros = {"x": torch.zeros(100_000)}
    step = {"x": torch.full((100_000,), 1e-4)}  # norm 0.03 < C = 1: not clipped
    for rnd in (1, 2, 3):
        messages = list(strategy.configure_train(rnd, ArrayRecord(zeros), ConfigRecord({}), _Nodes(4)))
        assert len(messages) == 2
        replies = hooks.prepare(_replies(messages, [step, step], [3.0, 70.0]), ArrayRecord(zeros))
        assert [r.content["metrics"]["weight"] for r in replies] == [1.0, 1.0]  # equal under DP
        merged, _ = strategy.aggregate_train(rnd, replies)
        noise = merged.to_torch_state_dict()["x"] - 1e-4
        sigma = z * 1.0 / 2  # z C / m
        assert abs(float(noise.std()) - sigma) < 5 * sigma / math.sqrt(2 * noise.numel())
        assert abs(float(noise.mean())) < 5 * sigma / math.sqrt(noise.numel())
        metrics = hooks.round_metrics(rnd, 2, True)
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=0.5, noise_multiplier=z, steps=3, orders=orders)
    expected, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    assert metrics["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert hooks.summary()["privacy"]["rounds_accounted"] == 3


@pytest.mark.parametrize("spec", ["fp16", "int8", "topk:0.1", "sign", "powersgd:2"])
def test_compressed_updates_decode_and_error_feedback_catches_up(spec: str) -> None:
    gen = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(24, 16, generator=gen), "b": torch.randn(16, generator=gen), "n": torch.tensor(2)}
    codec = UpdateCodec(spec)
    residuals: dict[str, torch.Tensor] = {}
    sent = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in base.items() if v.is_floating_point()}
    true = {k: torch.zeros_like(v) for k, v in sent.items()}
    for _ in range(30):  # the same update each round: error feedback sends what was left
        delta = {k: 0.01 * torch.randn(v.shape, generator=gen) for k, v in true.items()}
        new = {**{k: base[k] + delta[k] for k in delta}, "n": torch.tensor(3)}
        payload, ctx, residuals = codec.encode(base, new, residuals)
        decoded = codec.decode(base, payload, ctx)
        assert decoded["n"].item() == 3
        for k in sent:
            sent[k] += decoded[k] - base[k]
            true[k] += delta[k]
    for k in sent:  # the sum of what was sent trails the sum of the updates by one residual
        torch.testing.assert_close(sent[k] + residuals[k].reshape(sent[k].shape), true[k], rtol=0, atol=1e-4)
    assert sum(p.numel() * p.element_size() for p in payload.values()) < sum(
        v.numel() * 4 for v in base.values()
    ) or spec == "fp16"


def test_fedadam_state_and_server_checkpoint_round_trip(tmp_path: Path) -> None:
    config = _toy(clients=2, strategy="fedadam", min_clients=2)
    strategy = build_strategy(config)
    w = {"x": torch.zeros(8)}
    messages = list(strategy.configure_train(1, ArrayRecord(w), ConfigRecord({}), _Nodes(2)))
    merged, _ = strategy.aggregate_train(1, _replies(messages, [{"x": torch.ones(8)}] * 2, [1.0, 1.0]))
    state = strategy_state(strategy)
    assert set(state) == {"m_t", "v_t"}
    ckpt = ServerCheckpoint(tmp_path)
    ckpt.save(ServerState(round=1, model=merged.to_torch_state_dict(), strategy=state, rounds=[{"round": 1}]))
    ckpt.save(ServerState(round=2, model=merged.to_torch_state_dict(), strategy=state, rounds=[{"round": 1}, {"round": 2}]))
    (tmp_path / "server" / "round_00002" / "model.pt").write_bytes(b"torn")  # a damaged newest one
    latest = ckpt.latest()
    assert latest is not None and latest.round == 1
    fresh = build_strategy(config)
    load_strategy_state(fresh, latest.strategy)
    torch.testing.assert_close(torch.from_numpy(fresh.m_t["x"]), state["m_t"]["x"])
    with pytest.raises(ValueError, match="another strategy"):
        load_strategy_state(build_strategy(_toy(clients=2, strategy="fedavgm")), latest.strategy)


def test_stragglers_are_a_seeded_share_doing_part_of_their_steps() -> None:
    config = _toy(clients=10, stragglers=0.3)
    steps = [straggler_steps(config, server_round=4, partition_id=i, steps=20) for i in range(10)]
    assert steps == [straggler_steps(config, server_round=4, partition_id=i, steps=20) for i in range(10)]
    slow = [s for s in steps if s < 20]
    assert 1 <= len(slow) <= 3 and all(1 <= s for s in slow)
    other = [straggler_steps(config, server_round=5, partition_id=i, steps=20) for i in range(10)]
    assert other != steps


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "fedmagic"}, "unknown strategy 'fedmagic'"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"clients": 2, "min_clients": 3}, "min_clients \\(3\\) is more than the 2 clients"),
        ({"privacy": {"noise_multiplier": 1.0}}, "DP without a delta"),
        ({"compression": "randomk:0.1"}, "cannot encode a single client's update"),
        ({"compression": "topk:2"}, "federated compression"),
        ({"strategy": "fedprox", "client": {"nproc": 2, "zero_stage": 2}}, "FedProx's proximal term needs DDP"),
        ({"partition": "package"}, "partition 'package' splits the built-in corpus"),
        ({"privacy": {"noise_multiplier": 1.0, "delta": 1e-5}, "strategy": "fedadam"}, "DP accounting"),
    ],
)
def test_bad_config_is_one_clear_error(kwargs: dict, match: str) -> None:
    data = json.loads(_toy().to_json())
    for key, value in kwargs.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=match):
        FederatedConfig.from_dict(data)


def test_adaptive_compression_follows_each_clients_link() -> None:
    from torsh_distributed.federated.updates import LADDER, LinkAdaptation

    link = LinkAdaptation(budget=8.0)
    for _ in range(3):
        link.observe(1, 20.0)  # a slow link: up the ladder, one step a round
        link.observe(2, 1.0)  # a fast one stays uncompressed
    assert [link.method(1), link.method(2)] == [LADDER[3], "none"]
    link.observe(1, 5.0)  # within budget: stays
    link.observe(1, 1.0)  # far under: one step back
    assert link.method(1) == LADDER[2]
    restored = LinkAdaptation(budget=8.0)
    restored.load_state_dict(json.loads(json.dumps(link.state_dict())))
    assert restored.method(1) == LADDER[2]

    config = _toy(clients=2, min_clients=2, compression="adaptive")
    hooks = FederatedHooks(config)
    hooks.adaptive.level = {100: 2}  # node 100 on int8, node 101 uncompressed
    strategy = build_strategy(config)
    zeros = {"w": torch.zeros(64, 8)}
    messages = list(strategy.configure_train(1, ArrayRecord(zeros), ConfigRecord({"spec": "{}"}), _Nodes(2)))
    chosen = hooks.configure(messages)
    assert chosen == {100: "int8", 101: "none"}
    by_node = {m.metadata.dst_node_id: m for m in messages}
    assert {n: m.content["config"]["compression"] for n, m in by_node.items()} == chosen  # each its own
    new = {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) * 0.01}
    payload, ctx, _ = UpdateCodec("int8").encode(zeros, new, {})
    compressed = _replies([by_node[100]], [payload], [1.0])[0]
    compressed.content["torsh-update"] = ConfigRecord({"json": ctx})
    plain = _replies([by_node[101]], [new], [1.0])[0]
    decoded = hooks.prepare([compressed, plain], ArrayRecord(zeros))
    got = decoded[0].content["arrays"].to_torch_state_dict()["w"]
    torch.testing.assert_close(got, new["w"], rtol=0, atol=float(new["w"].abs().max()) / 127)
    assert "torsh-update" not in decoded[0].content
