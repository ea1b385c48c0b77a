"""The collectives facade on NCCL (native AVG for MEAN, CUDA tensors through our algorithms).
Skipped without CUDA; not yet run on a GPU (none was available when it was written)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.comm import ReduceOp
from torsh_distributed.comm import collectives as C
from torsh_distributed.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]


def _facade_on_nccl() -> list[float]:
    device = torch.device("cuda", torch.cuda.current_device())
    n = dist.get_world_size()
    out = []
    for algo in ("torch", "ring", "tree"):
        t = torch.full((1001,), float(dist.get_rank() + 1), device=device)
        C.all_reduce(t, ReduceOp.MEAN, algorithm=algo)
        out.append(t[0].item())
    assert all(abs(v - (n + 1) / 2) < 1e-6 for v in out), out
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_facade_mean_on_two_gpus():
    results = run_distributed(_facade_on_nccl, 2, backend="nccl", timeout=120)
    assert results[0] == results[1] == [1.5, 1.5, 1.5]
