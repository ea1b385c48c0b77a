"""A federated client that is itself a 2-rank data-parallel job (DDP, and ZeRO-2) computes the same
update as a 1-rank client on the same data (1e-5): the engine splits each step's global batch
among the client's ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torsh_distributed.federated.client import train_round
from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.task import Task

TOY = Path(__file__).parents[1] / "integration" / "_federated_toy.py"

pytestmark = pytest.mark.timeout(180)


def _config(**client: object) -> FederatedConfig:
    task = TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset")
    settings = {"local_steps": 3, "batch_size": 8, "lr": 0.2, "momentum": 0.5, **client}
    return FederatedConfig(partition="iid", clients=2, task=task, client=ClientConfig(**settings))  # type: ignore[arg-type]


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_two_rank_client_update_equals_one_rank(zero_stage: int) -> None:
    one = _config()
    initial = Task(one).model().state_dict()
    alone = train_round(one, initial, partition_id=1, server_round=2)
    pair = train_round(_config(nproc=2, zero_stage=zero_stage), initial, partition_id=1, server_round=2)
    assert pair.steps == alone.steps == 3
    assert pair.num_examples == alone.num_examples == 16
    assert pair.loss == pytest.approx(alone.loss, abs=1e-5)
    assert set(pair.state) == set(alone.state)
    for name, tensor in alone.state.items():
        torch.testing.assert_close(pair.state[name], tensor, rtol=0, atol=1e-5)
    moved = sum(float((alone.state[k] - initial[k]).abs().sum()) for k in initial)
    assert moved > 1e-3  # the clients really trained


def test_a_client_trains_at_the_threads_its_process_was_given() -> None:
    """The clients sharing a host train at once: a client's engine keeps the threads its process
    has (the deployment's ``OMP_NUM_THREADS``), not the engine's default of every core."""
    from torsh_distributed.runtime.busy import usable_cores

    if usable_cores() < 2:
        pytest.skip("one usable core: every default is 1 thread")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _config()
        train_round(one, Task(one).model().state_dict(), partition_id=0, server_round=1)
        assert torch.get_num_threads() == 1  # the engine's own default here: usable_cores() // 1
    finally:
        torch.set_num_threads(before)


def test_a_batch_the_client_ranks_cannot_split_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match=r"client.batch_size 7 is split among the client's 2 ranks"):
        ClientConfig(nproc=2, batch_size=7)


def test_a_failed_client_job_names_the_client_and_shows_the_ranks_error() -> None:
    """A rank of the client's job raises (here: a model whose forward fails): the round's error
    names the client and carries that rank's traceback, not the launcher's."""
    bad = TaskConfig(model=f"{TOY}:make_broken_model", dataset=f"{TOY}:dataset")
    ok = _config(nproc=2)
    config = FederatedConfig(partition="iid", clients=2, task=bad, client=ok.client)
    with pytest.raises(RuntimeError, match=r"(?s)client 1's 2-rank job failed \(exit 1\).*broken on purpose"):
        train_round(config, Task(ok).model().state_dict(), partition_id=1, server_round=1)
