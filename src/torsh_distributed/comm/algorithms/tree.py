"""Binomial-tree broadcast and reduce: ``ceil(log2 p)`` rounds, each moving the whole buffer.

Latency-optimal (``log p`` alpha instead of ``2 (p - 1)``), bandwidth-poor (``log p`` full
copies); the right choice for small messages on many ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torsh_distributed.comm.algorithms._p2p import exchange, flat_view, group_rank, write_back
from torsh_distributed.comm.reduce_op import ReduceOp, combine_, finish_mean_

__all__ = ["tree_broadcast", "tree_reduce", "tree_all_reduce"]


def tree_broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Broadcast ``tensor`` from group rank ``src`` down a binomial tree, in place."""
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    flat = flat_view(tensor)
    v = (group_rank(group) - src) % n
    mask = 1
    while mask < n:
        if v < mask and v + mask < n:
            exchange(group, send=flat, dst=(v + mask + src) % n)
        elif mask <= v < 2 * mask:
            exchange(group, recv=flat, src=(v - mask + src) % n)
        mask <<= 1
    write_back(tensor, flat)
    return tensor


def tree_reduce(
    tensor: torch.Tensor, dst: int, op: ReduceOp, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Reduce into ``tensor`` on group rank ``dst`` up a binomial tree.

    Other ranks' ``tensor`` ends up holding partial results (as with torch's ``reduce``).
    """
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    flat = flat_view(tensor)
    v = (group_rank(group) - dst) % n
    scratch = torch.empty_like(flat)
    mask = 1
    while mask < n:
        if v & mask:
            exchange(group, send=flat, dst=((v ^ mask) + dst) % n)
            break
        peer = v | mask
        if peer < n:
            exchange(group, recv=scratch, src=(peer + dst) % n)
            combine_(flat, scratch, op)
        mask <<= 1
    if v == 0:
        finish_mean_(flat, op, n)
    write_back(tensor, flat)
    return tensor


def tree_all_reduce(
    tensor: torch.Tensor, op: ReduceOp, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Tree reduce to group rank 0, then tree broadcast from it."""
    tree_reduce(tensor, 0, op, group)
    return tree_broadcast(tensor, 0, group)
