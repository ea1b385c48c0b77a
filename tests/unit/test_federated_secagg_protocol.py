"""SecAgg+ in one process: Flower's workflow and ``secaggplus_mod``, our round driver and client
handler, and real local training (the toy task), over an in-process grid that copies every
message as a transport would and turns a client's exception into an error reply.

- settings the workflow refuses or breaks on are refused before anything is sent;
- the aggregate equals the plain FedAvg aggregate (weighted by the clients' unequal shares)
  within the stated bound, and the replies hold only masked vectors;
- a client dropping after each stage (setup, share_keys, collect_masked_vectors) is tolerated;
  Flower 1.42's workflow alone halts when the drop is in setup/share_keys (checked too);
- more drops than the threshold allows halt the round with no model.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from torsh_distributed.federated import _secagg_driver, secagg
from torsh_distributed.federated.client import LocalResult, train_round
from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.secagg import (
    DEFAULT_QUANTIZATION_RANGE,
    check_secagg,
    default_max_weight,
    quantization_bound,
    secagg_client_app,
    secagg_round,
)
from torsh_distributed.federated.task import Task

TOY = Path(__file__).parents[1] / "integration" / "_federated_toy.py"


class SlowStartGrid:
    """An :class:`InProcessGrid` behind push/pull: each reply becomes visible ``delay`` seconds
    after its message was pushed, as when a SuperNode first starts a ClientApp process."""

    def __init__(self, grid: InProcessGrid, delay: float) -> None:
        self.grid, self.delay = grid, delay
        self.ready: dict[str, tuple[float, Message]] = {}

    def get_node_ids(self) -> list[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Any) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = mid = uuid.uuid4().hex  # as Flower's grids do
            for reply in self.grid.send_and_receive([msg]):
                self.ready[mid] = (time.monotonic() + self.delay, reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        now = time.monotonic()
        due = [i for i in message_ids if i in self.ready and self.ready[i][0] <= now]
        return [self.ready.pop(i)[1] for i in due]


class InProcessGrid:
    """Nodes ``1000 + 7 i`` (partition ``i``) running :data:`secagg_client_app` here."""

    def __init__(self, num_clients: int) -> None:
        self.contexts = {
            1000 + 7 * i: Context(
                run_id=1,
                node_id=1000 + 7 * i,
                state=RecordDict(),
                run_config={},
                node_config={"partition-id": i, "num-partitions": num_clients},
            )  # fmt: skip
            for i in range(num_clients)
        }
        self.dead: set[int] = set()
        self.replies: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        del timeout
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node in self.dead:
                continue  # no answer: the stage closes at its timeout
            incoming = copy.deepcopy(msg)  # the mod edits what it receives
            try:
                reply = secagg_client_app(incoming, self.contexts[node])
            except Exception as exc:  # noqa: BLE001 - as Flower turns it into an error reply
                reason = f"{type(exc).__name__}: {exc}"
                reply = Message(Error(code=0, reason=reason), reply_to=incoming)
            out.append(copy.deepcopy(reply))
        self.replies += out
        return out


@pytest.fixture(autouse=True)
def _task_identity() -> Iterator[None]:
    """Messages are stamped with the process's run (set by Flower's ServerApp runtime)."""
    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def _config(clients: int, **kw: Any) -> FederatedConfig:
    task = TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset")
    client = ClientConfig(local_steps=2, batch_size=4, lr=0.5)
    return FederatedConfig(
        partition="iid", task=task, client=client, clients=clients, run_dir="unused", **kw
    )


_PLAIN: dict[tuple[str, int], LocalResult] = {}


def _plain_fedavg(config: FederatedConfig, partitions: list[int]) -> dict[str, torch.Tensor]:
    init = Task(config).model().state_dict()
    results = []
    for pid in partitions:
        key = (config.to_json(), pid)
        if key not in _PLAIN:
            _PLAIN[key] = train_round(config, init, partition_id=pid, server_round=1)
        results.append(_PLAIN[key])
    total = sum(r.num_examples for r in results)
    return {k: sum(r.state[k].double() * r.num_examples for r in results) / total for k in init}


def _round(
    grid: InProcessGrid | SlowStartGrid, config: FederatedConfig, **kw: Any
) -> secagg.SecAggResult:
    kw.setdefault("num_shares", 0)
    kw.setdefault("reconstruction_threshold", 3)
    return secagg_round(
        grid, config=config, server_round=1, global_state=Task(config).model().state_dict(),
        node_ids=grid.get_node_ids(), **{"timeout": 1.0, **kw},
    )  # fmt: skip


def _assert_within_bound(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: float
) -> None:
    assert 0 < bound < 1e-4
    for name, tensor in want.items():
        atol = (
            bound + float(tensor.abs().max()) * 2**-24
        )  # plus the float32 rounding of the weights
        err = float((got[name].double() - tensor).abs().max())
        assert err <= atol, f"{name}: error {err:.3g} > bound {atol:.3g}"


# --- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("clients", "kw", "match"),
    [
        (1, {}, "at least 2 clients"),
        (5, {"num_shares": 4}, "num_shares must be odd"),
        (5, {"num_shares": 6}, r"num_shares must be in \[0, 5\]"),
        (5, {"reconstruction_threshold": 2}, "more than half of num_shares"),
        (5, {"num_shares": 3, "reconstruction_threshold": 4}, "at most num_shares"),
        (5, {"quantization_range": 3_000_000}, "power of two"),
        (1024, {"reconstruction_threshold": 600}, r"must be < 2\*\*32"),
        (5, {"clipping_range": 0.0}, "clipping_range must be > 0"),
        (5, {"max_weight": -1.0}, "max_weight must be > 0"),
    ],
)
def test_check_secagg_refuses(clients: int, kw: dict[str, Any], match: str) -> None:
    settings: dict[str, Any] = {"num_shares": 0, "reconstruction_threshold": 3, **kw}
    with pytest.raises(ValueError, match=match):
        check_secagg(clients, **settings)


def test_check_secagg_accepts_all_shares_and_a_full_threshold() -> None:
    check_secagg(2, num_shares=0, reconstruction_threshold=2)
    check_secagg(4, num_shares=4, reconstruction_threshold=4)  # even is fine when it is everyone
    check_secagg(7, num_shares=5, reconstruction_threshold=3)


def test_secagg_round_refuses_one_client_before_sending_anything() -> None:
    grid = InProcessGrid(1)
    with pytest.raises(ValueError, match="at least 2 clients"):
        secagg_round(
            grid, config=_config(2), server_round=1, global_state={}, node_ids=grid.get_node_ids(),
            timeout=1.0, num_shares=0, reconstruction_threshold=1,
        )  # fmt: skip
    assert grid.replies == []


def test_quantization_bound_and_max_weight() -> None:
    q = DEFAULT_QUANTIZATION_RANGE
    # equal shares, W = n: 2c/Q
    assert (
        quantization_bound([16, 16], clipping_range=8.0, quantization_range=q, max_weight=16)
        == 16 / q
    )
    # W = 2n halves each weight: twice the bound
    assert (
        quantization_bound([8, 8, 8], clipping_range=1.0, quantization_range=q, max_weight=16)
        == 4 / q
    )
    assert default_max_weight(_config(3)) == 16  # shares of 11, 11, 10 of the 32 items
    assert default_max_weight(_config(5)) == 8


# --- rounds ------------------------------------------------------------------------------------


def test_aggregate_equals_weighted_fedavg_and_replies_are_masked() -> None:
    config = _config(3)
    grid = InProcessGrid(3)
    result = _round(grid, config, reconstruction_threshold=2)
    assert result.ok and result.completed == 3 and result.dropped == 0 and result.clipped == 0
    assert [c["examples"] for c in result.clients] == [11, 11, 10]  # unequal weights
    assert result.max_weight == 16
    _assert_within_bound(result.state, _plain_fedavg(config, [0, 1, 2]), result.error_bound)
    assert set(result.stage_bytes) == set(secagg.STAGES)
    assert result.bytes["total"] == result.bytes["down"] + result.bytes["up"] > 0

    from flwr.common import bytes_to_ndarray

    assert [r.metadata.message_type for r in grid.replies[:3]] == [_secagg_driver.PROBE_TYPE] * 3
    for reply in grid.replies[3:]:
        assert all(len(record) == 0 for record in reply.content.array_records.values())
        masked = reply.content.config_records["secaggplus_configs"].get("masked_params", [])
        for blob in masked[1:]:  # [0] is the weight factor
            assert bytes_to_ndarray(blob).max() > 2 * DEFAULT_QUANTIZATION_RANGE


@pytest.mark.parametrize(
    ("stage", "completed"),
    [("setup", 4), ("share_keys", 4), ("collect_masked_vectors", 5)],
)
def test_one_of_five_drops_after_each_stage(stage: str, completed: int) -> None:
    config = _config(5)
    grid = InProcessGrid(5)
    victim = grid.get_node_ids()[-1]

    def drop(name: str, active: list[int]) -> None:
        if name == stage:
            grid.dead.add(victim)

    result = _round(grid, config, on_stage=drop)
    assert result.failed_stage is None and result.completed == completed
    partitions = [c["partition_id"] for c in result.clients]
    assert partitions == list(range(completed))  # after collect, its update is in the sum
    _assert_within_bound(result.state, _plain_fedavg(config, partitions), result.error_bound)


def test_flower_alone_halts_when_a_client_drops_before_sharing_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_secagg_driver, "forget_silent", lambda state: None)
    grid = InProcessGrid(5)
    victim = grid.get_node_ids()[-1]
    result = _round(
        grid,
        _config(5),
        on_stage=lambda name, _: grid.dead.add(victim) if name == "setup" else None,
    )
    assert result.failed_stage == "unmask" and result.state is None


def test_more_drops_than_the_threshold_allows_halt_the_round() -> None:
    grid = InProcessGrid(5)
    victims = grid.get_node_ids()[-2:]

    def drop(name: str, active: list[int]) -> None:
        if name == "share_keys":
            grid.dead.update(victims)

    result = _round(grid, _config(5), reconstruction_threshold=4, on_stage=drop)
    assert result.failed_stage == "collect_masked_vectors"
    assert result.state is None and result.completed == 0 and result.error_bound == float("inf")


def test_client_app_answers_the_start_up_probe() -> None:
    grid = InProcessGrid(2)
    node = grid.get_node_ids()[0]
    probe = Message(RecordDict(), dst_node_id=node, message_type=_secagg_driver.PROBE_TYPE)
    reply = secagg_client_app(probe, grid.contexts[node])  # no handler: ValueError
    assert not reply.has_error()
    assert reply.metadata.message_type == _secagg_driver.PROBE_TYPE


def test_stages_wait_their_timeout_beyond_the_measured_start_up() -> None:
    """Replies take 1 s (ClientApps starting), each stage's timeout is 0.5 s: the probe measures
    the start-up and every stage waits for it on top of its timeout."""
    config = _config(3)
    grid = InProcessGrid(3)
    result = _round(SlowStartGrid(grid, delay=1.0), config, timeout=0.5, reconstruction_threshold=2)
    assert result.errors == []
    assert result.failed_stage is None and result.completed == 3, result
    assert result.startup_seconds >= 1.0
    _assert_within_bound(result.state, _plain_fedavg(config, [0, 1, 2]), result.error_bound)


def test_a_client_over_max_weight_refuses_and_says_why() -> None:
    grid = InProcessGrid(3)
    result = _round(grid, _config(3), reconstruction_threshold=2, max_weight=8)  # shares of 11
    assert result.failed_stage == "collect_masked_vectors" and result.state is None
    assert any("holds 11 examples, more than max_weight 8" in e for e in result.errors), (
        result.errors
    )


def test_dropped_stragglers_take_part_with_weight_zero() -> None:
    config = _config(3, stragglers=0.34, straggler_policy="drop")  # one straggler per round
    grid = InProcessGrid(3)
    result = _round(grid, config, reconstruction_threshold=2)
    assert result.ok and result.completed == 3
    slow = [c["partition_id"] for c in result.clients if c["straggler"]]
    assert len(slow) == 1 and all(c["weight"] == 0 for c in result.clients if c["straggler"])
    kept = [c["partition_id"] for c in result.clients if not c["straggler"]]
    _assert_within_bound(result.state, _plain_fedavg(config, kept), result.error_bound)
