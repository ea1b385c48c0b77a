"""Horovod's data-movement collectives on the collectives facade: ``allgather`` (uneven first
dimensions), ``broadcast``, ``alltoall`` (with splits), their in-place, asynchronous and grouped
forms, the sparse all-reduce of the optimizer, ``barrier`` and ``join``.

As in :mod:`._allreduce`: the out-of-place forms are differentiable (Horovod's backward), the
``_async`` forms return a :class:`Handle`, and ranks must issue collectives in the same order
(``name=`` is recorded, not used for matching).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

from torsh_distributed.comm import collectives as C
from torsh_distributed.compat.horovod._allreduce import allreduce, check_tensor
from torsh_distributed.compat.horovod._basics import (
    Op,
    check_process_set,
    global_process_set,
    rank,
    resolve_op,
    size,
)
from torsh_distributed.compat.horovod._handles import Handle, guard, staged, synchronize

__all__ = [
    "allgather",
    "allgather_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "join",
    "sparse_allreduce_async",
]


# -- all-gather ---------------------------------------------------------------------------------
def _first_dims(tensor: torch.Tensor, operation: str) -> list[int]:
    """Every rank's first dimension; ValueError (on every rank) when the rest of the shape or the
    dtype differs between ranks."""
    if tensor.dim() == 0:
        raise ValueError(f"{operation} needs a tensor with at least one dimension, got a scalar")
    signature = zlib.crc32(repr((tuple(tensor.shape[1:]), str(tensor.dtype))).encode())
    meta = torch.tensor([tensor.shape[0], signature], dtype=torch.int64)
    wire, back = staged(meta)
    parts = [torch.empty_like(wire) for _ in range(size())]
    with guard(operation):
        C.all_gather(parts, wire)
    rows = [p.cpu() for p in parts]
    odd = [r for r, m in enumerate(rows) if int(m[1]) != int(rows[0][1])]
    if odd:
        raise ValueError(
            f"{operation}: the tensors of ranks {odd} differ from rank 0's beyond the first "
            f"dimension or in dtype (this rank: shape {tuple(tensor.shape)}, {tensor.dtype}); "
            "only the first dimension may differ"
        )
    return [int(m[0]) for m in rows]


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
    check_process_set(process_set)
    check_tensor(tensor, "allgather")
    source = tensor.detach().contiguous()
    dims = _first_dims(source, "allgather")
    longest = max(dims)
    padded = source
    if source.shape[0] != longest:
        padded = source.new_zeros((longest, *source.shape[1:]))
        padded[: source.shape[0]] = source
    wire, _ = staged(padded)
    parts = [torch.empty_like(wire) for _ in dims]
    with guard("allgather"):
        work = C.all_gather(parts, wire, async_op=True)

    def finish() -> torch.Tensor:
        out = torch.cat([p[:n] for p, n in zip(parts, dims, strict=True)])
        return out.to(tensor.device)

    return Handle([work], finish, operation="allgather", name=name)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any) -> Any:
        ctx.dim = tensor.shape[0]
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=Op.AVERAGE)  # Horovod's backward averages
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64))
        offset = int(dims[: rank()].sum())
        return reduced.narrow(0, offset, ctx.dim), None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order (differentiable).

    Only the first dimension may differ between ranks.
    """
    check_process_set(process_set)
    check_tensor(tensor, "allgather")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name)
    return synchronize(allgather_async(tensor, name))


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    """Start :func:`allgather` of each tensor; ``synchronize`` returns the list."""
    handles = [allgather_async(t, name, process_set) for t in tensors]
    return Handle([], lambda: [h.wait() for h in handles], operation="grouped_allgather", name=name)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor, in list order."""
    return [allgather(t, name, process_set) for t in tensors]


# -- broadcast ----------------------------------------------------------------------------------
def _check_root(root_rank: int, operation: str) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"{operation}: root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < size():
        raise ValueError(f"{operation}: root_rank must be in [0, {size()}), got {root_rank}")


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start copying ``root_rank``'s ``tensor`` into ``tensor`` on every rank (in place)."""
    check_process_set(process_set)
    check_tensor(tensor, "broadcast")
    _check_root(root_rank, "broadcast")
    target = tensor.detach()
    if not target.is_contiguous():
        raise ValueError("broadcast: the tensor must be contiguous (call .contiguous())")
    wire, back = staged(target)
    with guard("broadcast"):
        work = C.broadcast(wire, root_rank, async_op=True)

    def finish() -> torch.Tensor:
        back()
        return tensor

    return Handle([work], finish, operation="broadcast", name=name)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Like :func:`broadcast_async_` into a new tensor; ``tensor`` is not modified."""
    check_tensor(tensor, "broadcast")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_async_(out, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Copy ``root_rank``'s ``tensor`` into ``tensor`` on every rank; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any) -> Any:
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad, op=Op.AVERAGE)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor (differentiable)."""
    check_process_set(process_set)
    check_tensor(tensor, "broadcast")
    if tensor.requires_grad and torch.is_grad_enabled():
        _check_root(root_rank, "broadcast")
        return _Broadcast.apply(tensor, root_rank, name)
    return synchronize(broadcast_async(tensor, root_rank, name))


# -- all-to-all ---------------------------------------------------------------------------------
def _send_splits(tensor: torch.Tensor, splits: Any) -> list[int]:
    world = size()
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
    rows = tensor.shape[0]
    if splits is None:
        if rows % world:
            raise ValueError(
                f"alltoall without splits divides dim 0 evenly: {rows} rows over {world} ranks "
                "does not divide; pass splits="
            )
        return [rows // world] * world
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if len(values) != world or any(int(v) != v or v < 0 for v in values):
        raise ValueError(
            f"alltoall: splits must be {world} non-negative integers (one per rank), got {values}"
        )
    if sum(values) != rows:
        raise ValueError(f"alltoall: splits sum to {sum(values)} but dim 0 has {rows} rows")
    return [int(v) for v in values]


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` to rank ``i``; ``synchronize`` returns
    ``(output, received_splits)`` (int32, one count per sender)."""
    check_process_set(process_set)
    check_tensor(tensor, "alltoall")
    source = tensor.detach().contiguous()
    send = _send_splits(source, splits)
    _first_dims(source, "alltoall")  # same trailing shape and dtype everywhere
    counts = torch.tensor(send, dtype=torch.int64)
    wire_counts, _ = staged(counts)
    received = torch.empty_like(wire_counts)
    with guard("alltoall"):
        C.all_to_all_single(received, wire_counts)
    recv = [int(v) for v in received.cpu()]
    wire_in, _ = staged(source)
    out = wire_in.new_empty((sum(recv), *source.shape[1:]))
    with guard("alltoall"):
        work = C.all_to_all_single(out, wire_in, recv, send, async_op=True)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        return out.to(tensor.device), torch.tensor(recv, dtype=torch.int32)

    return Handle([work], finish, operation="alltoall", name=name)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        back, _ = alltoall(grad.contiguous(), splits=ctx.received)
        return back, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Any:
    """Scatter row blocks of ``tensor`` to the ranks and gather theirs (differentiable).

    Args:
        tensor: Rows to send, rank 0's block first.
        splits: Rows for each rank (a list or int tensor of ``size()`` counts); ``None`` splits
            dim 0 evenly.

    Returns:
        The received rows, in sender order; with ``splits``, also the int32 tensor of rows
        received from each rank.
    """
    check_process_set(process_set)
    check_tensor(tensor, "alltoall")
    if tensor.requires_grad and torch.is_grad_enabled():
        output, received = _Alltoall.apply(tensor, splits, name)
    else:
        output, received = synchronize(alltoall_async(tensor, splits, name))
    return output if splits is None else (output, received)


# -- sparse gradients ---------------------------------------------------------------------------
def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None, op: Any, process_set: Any = global_process_set
) -> Handle:
    """Reduce a sparse COO tensor by all-gathering its indices and values (Horovod's way);
    Average divides the values by the world size. ``synchronize`` returns a sparse tensor."""
    check_process_set(process_set)
    rop = resolve_op(op)
    if rop not in (Op.AVERAGE, Op.SUM):
        raise ValueError("sparse allreduce supports Average and Sum only")
    t = tensor.coalesce()
    indices = allgather_async(t.indices().transpose(0, 1).contiguous(), f"{name}.indices")
    values = allgather_async(t.values(), f"{name}.values")

    def finish() -> torch.Tensor:
        vals = values.wait()
        idx = indices.wait()
        if rop is Op.AVERAGE:
            vals = vals / size()
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.shape)

    return Handle([], finish, operation="sparse_allreduce", name=name)


# -- synchronisation ----------------------------------------------------------------------------
def barrier(process_set: Any = global_process_set) -> None:
    """Block until every rank arrives."""
    check_process_set(process_set)
    size()  # raises before init, as Horovod does
    with guard("barrier"):
        C.barrier()


def join(device: int = -1) -> int:
    """Horovod's ``join`` for uneven inputs is not implemented (beyond a world of one).

    Horovod's joined ranks keep answering the other ranks' all-reduces with zeros, which its
    name-based coordinator makes possible; torch.distributed matches collectives by order and has
    no such coordinator. Give every rank the same number of batches instead (``drop_last=True``,
    or :class:`torsh_distributed.data.DistributedBatchSampler`), or use torch's
    ``torch.distributed.algorithms.Join`` with DDP.
    """
    if size() == 1:
        return 0
    raise NotImplementedError(
        "hvd.join() is not supported by torsh_distributed's Horovod API: torch.distributed "
        "matches collectives by order, so a joined rank cannot shadow the others' all-reduces. "
        "Give every rank the same number of batches (drop_last=True) instead."
    )
