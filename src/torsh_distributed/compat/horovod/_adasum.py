"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021).

Two gradients ``a`` and ``b`` combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(orthogonal gradients add, parallel ones average). Over ``2^k`` ranks the pairs combine by
recursive doubling: at level ``d = 1, 2, 4, ...`` rank ``r`` exchanges its current vector with
rank ``r XOR d`` and both compute ``adasum(lower rank's, higher rank's)``, so after ``k`` levels
every rank holds the same binary-tree combination, bit for bit. Horovod's CPU path computes the
same tree (its vector-halving exchange sums the dot products of the halves); like Horovod we
need a power-of-two number of ranks, compute dot products and norms in fp64 (fp32 for
fp16/bf16 tensors) and treat a norm below ``sqrt(DBL_MIN)`` as zero (coefficient 1).

Each exchange sends the whole tensor, so ``log2(n)`` full-size messages per rank: simpler than
Horovod's halving, and as exact.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from torsh_distributed.comm import collectives as C

__all__ = ["adasum_pair", "adasum_allreduce_", "check_adasum_world"]

_TINY = math.sqrt(sys.float_info.min)


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``adasum(a, b)`` in ``a``'s dtype; ``a`` is the lower rank's vector, ``b`` the higher's."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"adasum_pair needs equal shapes and dtypes, got {a.shape}/{a.dtype} "
            f"and {b.shape}/{b.dtype}"
        )
    wide = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else torch.float64
    aw, bw = a.to(wide).reshape(-1), b.to(wide).reshape(-1)
    dot = float(torch.dot(aw, bw))
    anormsq = float(torch.dot(aw, aw))
    bnormsq = float(torch.dot(bw, bw))
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= _TINY else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= _TINY else 1.0
    return (acoeff * aw + bcoeff * bw).to(a.dtype).view_as(a)


def check_adasum_world(world_size: int) -> None:
    """Refuse a world size Adasum cannot combine (not a power of two)."""
    if world_size < 1 or world_size & (world_size - 1):
        raise NotImplementedError(
            f"Adasum needs a power-of-two number of ranks (recursive doubling), got {world_size}; "
            "use op=hvd.Average, or run on 1, 2, 4, 8, ... processes"
        )


def adasum_allreduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Replace ``tensor`` on every rank by the Adasum of all ranks' tensors (blocking).

    Raises:
        TypeError: not a floating-point tensor.
        NotImplementedError: the world size is not a power of two.
    """
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"Adasum needs a floating-point tensor, got {tensor.dtype}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_adasum_world(world)
    if world == 1:
        return tensor
    me = dist.get_rank()
    mine = tensor.detach().clone()
    theirs = torch.empty_like(mine)
    distance = 1
    while distance < world:
        partner = me ^ distance
        send = C.isend(mine, partner)
        recv = C.irecv(theirs, partner)
        send.wait()
        recv.wait()
        mine = adasum_pair(mine, theirs) if me < partner else adasum_pair(theirs, mine)
        distance *= 2
    with torch.no_grad():
        tensor.copy_(mine)
    return tensor
