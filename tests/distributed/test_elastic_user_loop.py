"""ElasticState in a user's own DDP loop at 2 ranks: ``elastic.run`` syncs ranks that start
apart, and after a crash a restarted loop resumes from the last durable commit and ends exactly
where an uninterrupted run ends (model, momentum and the learning-rate schedule restored)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torsh_distributed import elastic
from torsh_distributed.checkpoint import CheckpointManager
from torsh_distributed.parallel.data import apply_ddp
from torsh_distributed.testing import run_distributed

TOTAL = 8


class _Crash(Exception):
    pass


def _state(seed: int, manager: CheckpointManager | None) -> elastic.ElasticState:
    torch.manual_seed(seed)
    # init_sync=False: DDP does not broadcast, so ranks that start apart stay apart unless synced
    model = apply_ddp(nn.Linear(4, 1), init_sync=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # halves the rate every 2 steps: a resume that restarted the schedule would train differently
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return elastic.ElasticState(
        model=model, optimizer=optimizer, manager=manager, scheduler=scheduler, step=0,
        origin=f"seed {seed}",
    )  # fmt: skip


@elastic.run
def _train(state: elastic.ElasticState, crash_at: int | None = None) -> torch.Tensor:
    first = state.step
    weights = [torch.empty(5) for _ in range(2)]
    dist.all_gather(weights, _flat(state.model))
    assert torch.equal(weights[0], weights[1]), "ranks differ after elastic.run's sync"
    while state.step < TOTAL:
        if state.step == crash_at:
            raise _Crash
        g = torch.Generator().manual_seed(100 * state.step + dist.get_rank())
        x = torch.randn(8, 4, generator=g)
        state.optimizer.zero_grad()
        F.mse_loss(state.model(x), x.sum(1, keepdim=True)).backward()
        state.optimizer.step()
        state.scheduler.step()
        state.step += 1
        if state.step % 3 == 0:
            state.commit(step=state.step)
    if state.manager is not None:
        state.manager.wait()
    return torch.cat([_flat(state.model), torch.tensor([float(first)])])


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _resume_after_crash(directory: str) -> dict:
    rank = dist.get_rank()
    out: dict = {}
    reference = _train(_state(0, None))  # rank 0's seed everywhere, no interruption
    first = _state(rank, CheckpointManager(directory, async_save=False))
    try:  # every rank starts from its own seed; run syncs rank 0's weights and values
        _train(first, crash_at=5)
    except _Crash:
        pass
    out["synced_values"] = first.origin
    # a restarted process: new weights, empty optimizer state
    restarted = _state(10 + rank, CheckpointManager(directory, async_save=False))
    resumed = _train(restarted)
    out["resumed_from"] = int(resumed[-1])
    out["same_as_uninterrupted"] = torch.equal(resumed[:-1], reference[:-1])
    out["step"] = restarted.step
    out["lr"] = restarted.optimizer.param_groups[0]["lr"]
    return out


def test_user_loop_resumes_from_the_last_commit_like_an_uninterrupted_run(tmp_path):
    for out in run_distributed(_resume_after_crash, 2, args=(str(tmp_path),), timeout=180):
        assert out["resumed_from"] == 3  # committed at 3; the crash came at 5, before commit 6
        assert out["step"] == TOTAL
        assert out["same_as_uninterrupted"]
        assert out["synced_values"] == "seed 0"
        assert out["lr"] == 0.05 * 0.5 ** (TOTAL // 2)
