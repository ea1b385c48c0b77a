"""Point-to-point plumbing shared by the algorithms: group-relative ranks and paired exchange."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["members", "group_rank", "exchange", "flat_view", "write_back"]

_MEMBERS: dict[int, tuple[int, ...]] = {}


def members(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of ``group``'s members, in group-rank order (cached per group)."""
    pg = group if group is not None else dist.group.WORLD
    key = id(pg)
    found = _MEMBERS.get(key)
    if found is None:
        found = tuple(dist.get_process_group_ranks(pg))
        _MEMBERS[key] = found
    return found


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


def exchange(
    group: dist.ProcessGroup | None,
    *,
    send: torch.Tensor | None = None,
    dst: int | None = None,
    recv: torch.Tensor | None = None,
    src: int | None = None,
) -> None:
    """Send ``send`` to group rank ``dst`` while receiving ``recv`` from group rank ``src``.

    Both directions are posted before waiting, so a ring of ranks never deadlocks. Empty
    tensors are skipped on both sides (each side knows the sizes, so they agree).
    """
    ranks = members(group)
    ops = []
    if send is not None and send.numel():
        assert dst is not None
        ops.append(dist.P2POp(dist.isend, send, ranks[dst], group))
    if recv is not None and recv.numel():
        assert src is not None
        ops.append(dist.P2POp(dist.irecv, recv, ranks[src], group))
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor sharing memory with ``tensor`` when possible (else a copy)."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    return tensor.contiguous().view(-1)


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``tensor`` unless it already is a view of it."""
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
