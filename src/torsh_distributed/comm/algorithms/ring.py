"""Ring collectives over point-to-point messages: bandwidth-optimal, latency ~ 2 (p - 1) alpha.

All-reduce is a reduce-scatter followed by an all-gather; each of the ``p - 1`` steps of each
phase sends one ``1/p`` chunk to the right neighbour while receiving one from the left, so every
rank sends ``2 (p - 1) / p`` of the buffer in total, the lower bound for all-reduce. Chunks move in
segments of :data:`SEGMENT_BYTES`, each forwarded as soon as it arrives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torsh_distributed.comm.algorithms._p2p import flat_view, group_rank, members, write_back
from torsh_distributed.comm.reduce_op import ReduceOp, combine_, finish_mean_

__all__ = ["ring_reduce_scatter_", "ring_all_gather_", "ring_all_reduce"]


SEGMENT_BYTES = 64 << 10
"""Chunks travel in segments of this size, forwarded as soon as each arrives (pipelining), so the
link stays busy across step boundaries instead of idling while a whole chunk is reduced."""


def _ring_pass(
    chunks: list[torch.Tensor], group: dist.ProcessGroup | None, *, send0: int, op: ReduceOp | None
) -> None:
    """``n - 1`` pipelined ring steps: send ``chunks[send0]``, then forward what arrives.

    At step ``s`` this rank receives chunk ``send0 - 1 - s`` from the left (combined into place
    with ``op``, or copied when ``op`` is None) and forwards each segment to the right as soon as
    it is complete: that chunk is what the next step sends.
    """
    n, r = len(chunks), group_rank(group)
    ranks = members(group)
    right, left = ranks[(r + 1) % n], ranks[(r - 1) % n]
    seg = max(SEGMENT_BYTES // chunks[0].element_size(), 1)

    def segments(i: int) -> tuple[torch.Tensor, ...]:
        return chunks[i].split(seg) if chunks[i].numel() else ()

    sends = [dist.isend(t, right, group=group) for t in segments(send0)]
    recv_idx = (send0 - 1) % n
    for step in range(n - 1):
        targets = segments(recv_idx)
        bufs = targets if op is None else tuple(torch.empty_like(t) for t in targets)
        works = [dist.irecv(b, left, group=group) for b in bufs]
        for work, target, buf in zip(works, targets, bufs, strict=True):
            work.wait()
            if op is not None:
                combine_(target, buf, op)
            if step < n - 2:
                sends.append(dist.isend(target, right, group=group))
        recv_idx = (recv_idx - 1) % n
    for work in sends:
        work.wait()


def ring_reduce_scatter_(
    chunks: list[torch.Tensor], op: ReduceOp, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Reduce ``chunks`` (one per group rank) in place; afterwards ``chunks[r]`` on rank r is reduced.

    Other chunks hold partial results. Returns this rank's reduced chunk.
    """
    n, r = len(chunks), group_rank(group)
    assert n == dist.get_world_size(group), "one chunk per group rank"
    if n > 1:
        _ring_pass(chunks, group, send0=(r - 1) % n, op=op)
    return chunks[r]


def ring_all_gather_(chunks: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Spread ``chunks[r]`` of every rank r to all ranks, in place."""
    n, r = len(chunks), group_rank(group)
    if n > 1:
        _ring_pass(chunks, group, send0=r, op=None)


def ring_all_reduce(
    tensor: torch.Tensor, op: ReduceOp, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with a ring; uneven sizes (even fewer elements than ranks) work."""
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    flat = flat_view(tensor)
    chunks = list(flat.tensor_split(n))
    ring_reduce_scatter_(chunks, op, group)
    ring_all_gather_(chunks, group)
    finish_mean_(flat, op, n)
    write_back(tensor, flat)
    return tensor
