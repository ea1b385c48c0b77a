"""NCCL and CUDA paths. Skipped without CUDA; run wherever a GPU is available."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torsh_distributed as tdist
from torsh_distributed.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]


def test_auto_picks_nccl_and_a_device():
    with tdist.init(env={}) as rt:
        assert rt.backend == "nccl"
        assert rt.device == torch.device("cuda", 0)
        t = torch.ones(4, device=rt.device)
        dist.all_reduce(t)
        assert t.sum().item() == 4


def _nccl_all_reduce() -> float:
    device = torch.device("cuda", torch.cuda.current_device())
    t = torch.full((1024,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(t)
    return t[0].item()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_rank_nccl_all_reduce():
    assert run_distributed(_nccl_all_reduce, 2, backend="nccl", timeout=120) == [3.0, 3.0]


def _train_on_gpu() -> tuple[str, float, float]:
    from torsh_distributed.train import preset, train

    cfg = preset("tiny")
    cfg.max_steps = 30
    cfg.progress = False
    result = train(cfg)
    return result.backend, result.initial_loss, result.final_loss


def test_trainer_on_one_gpu():
    backend, first, last = run_distributed(_train_on_gpu, 1, backend="auto", timeout=180)[0]
    assert backend == "nccl"
    assert last < first - 1.0
