"""Horovod's all-reduce family on the collectives facade: ``allreduce`` (Average, Sum, Min, Max,
Product, Adasum; pre/post scaling; compression), its in-place, asynchronous and grouped forms,
and ``reducescatter``.

Semantics follow ``horovod/torch/mpi_ops.py``: the out-of-place forms leave the input alone and
are differentiable (the same backward as Horovod's autograd functions); the ``_`` forms work in
place; the ``_async`` forms return a :class:`Handle` for ``poll``/``synchronize``. One difference
is inherent to torch.distributed: Horovod matches operations across ranks by ``name``, torch by
the order in which ranks issue them. ``name=`` is accepted and kept on the handle, but every rank
must issue the same collectives in the same order (as DDP and every torch program do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torsh_distributed.comm import collectives as C
from torsh_distributed.comm.reduce_op import ReduceOp
from torsh_distributed.compat.horovod._adasum import adasum_allreduce_
from torsh_distributed.compat.horovod._basics import (
    Op,
    check_process_set,
    global_process_set,
    rank,
    resolve_op,
    size,
)
from torsh_distributed.compat.horovod._compression import NoneCompressor, TorshCompression
from torsh_distributed.compat.horovod._handles import (
    Handle,
    done,
    guard,
    scale_,
    staged,
    synchronize,
)

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "check_tensor",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
]

_TORCH_OP = {
    Op.AVERAGE: ReduceOp.SUM,
    Op.SUM: ReduceOp.SUM,
    Op.MIN: ReduceOp.MIN,
    Op.MAX: ReduceOp.MAX,
    Op.PRODUCT: ReduceOp.PRODUCT,
}


def check_tensor(tensor: Any, operation: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{operation} takes a torch.Tensor, got {type(tensor).__name__}")
    return tensor


# -- all-reduce ---------------------------------------------------------------------------------
def _allreduce_inplace(
    tensor: torch.Tensor,
    op: Op,
    prescale_factor: float,
    postscale_factor: float,
    name: str | None,
    operation: str,
) -> Handle:
    world = size()
    target = tensor.detach()
    if not target.is_contiguous():
        raise ValueError(f"{operation}: the tensor must be contiguous (call .contiguous())")
    wire, back = staged(target)
    if op is Op.ADASUM:  # blocking: a sequence of pairwise exchanges
        with guard(operation):
            scale_(wire, prescale_factor)
            adasum_allreduce_(wire)
            scale_(wire, postscale_factor)
        back()
        return done(tensor, operation=operation, name=name)
    scale_(wire, prescale_factor)
    with guard(operation):
        work = C.all_reduce(wire, _TORCH_OP[op], async_op=True)
    post = postscale_factor / world if op is Op.AVERAGE else postscale_factor

    def finish() -> torch.Tensor:
        scale_(wire, post)
        back()
        return tensor

    return Handle([work], finish, operation=operation, name=name)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start reducing ``tensor`` in place over all ranks; ``synchronize`` returns it.

    ``op``: Average (default), Sum, Min, Max, Product or Adasum (power-of-two worlds; blocking).
    The result is ``postscale * op(prescale * x)``, divided by the world size for Average.
    """
    check_process_set(process_set)
    check_tensor(tensor, "allreduce")
    return _allreduce_inplace(
        tensor, resolve_op(op, average), prescale_factor, postscale_factor, name, "allreduce"
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Like :func:`allreduce_async_` into a new tensor; ``tensor`` is not modified."""
    check_tensor(tensor, "allreduce")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(out, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` in place over all ranks and return it."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: Op, pre: float, post: float, name: Any) -> Any:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return synchronize(allreduce_async(tensor, None, name, op, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return (
            allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post),
            None,
            None,
            None,
            None,
        )


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = NoneCompressor,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks into a new tensor (differentiable).

    Args:
        tensor: The tensor; not modified.
        average: Deprecated (Horovod's); use ``op``.
        name: Recorded on the operation only (ranks must call collectives in the same order).
        compression: ``Compression.none``/``fp16`` (compress, all-reduce, decompress) or
            ``Compression.torsh(spec)`` (the compressor's own exchange; Average or Sum).
        op: Average (default), Sum, Min, Max, Product, Adasum.
        prescale_factor: Multiplies each rank's tensor before the reduction.
        postscale_factor: Multiplies the result.
        process_set: Only the global process set.
    """
    check_process_set(process_set)
    check_tensor(tensor, "allreduce")
    rop = resolve_op(op, average)
    if isinstance(compression, TorshCompression):
        with guard("allreduce"):
            return compression.reduce(
                tensor,
                op=rop,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                key=TorshCompression.key_for(name),
            )
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        reduced = _Allreduce.apply(compressed, rop, prescale_factor, postscale_factor, name)
    else:
        reduced = synchronize(
            allreduce_async(compressed, None, name, rop, prescale_factor, postscale_factor)
        )
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Start reducing every tensor of ``tensors`` in place; ``synchronize`` returns the list."""
    handles = [
        allreduce_async_(t, average, name, op, prescale_factor, postscale_factor, process_set)
        for t in tensors
    ]
    return Handle([], lambda: [h.wait() for h in handles], operation="grouped_allreduce", name=name)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """Like :func:`grouped_allreduce_async_` into new tensors."""
    outs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(
        outs, average, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """Reduce every tensor of ``tensors`` in place; returns them."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = NoneCompressor,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """:func:`allreduce` of each tensor, in list order (differentiable)."""
    return [
        allreduce(t, average, name, compression, op, prescale_factor, postscale_factor, process_set)
        for t in tensors
    ]


# -- reduce-scatter -----------------------------------------------------------------------------
def _scatter_rows(rows: int, world: int, me: int) -> tuple[int, int]:
    """Horovod's split: the first ``rows % world`` ranks get one extra row."""
    base, extra = divmod(rows, world)
    start = me * base + min(me, extra)
    return start, base + (1 if me < extra else 0)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Op.AVERAGE,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start reducing ``tensor`` over the ranks; each keeps its block of rows (Horovod's split:
    the first ``dim0 % size`` ranks get one more row). Implemented as an all-reduce, so it moves
    twice the bytes of a native reduce-scatter."""
    check_process_set(process_set)
    check_tensor(tensor, "reducescatter")
    rop = resolve_op(op)
    if rop is Op.ADASUM:
        raise ValueError("reducescatter: op must be Average, Sum, Min, Max or Product, not Adasum")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    full = allreduce_async(tensor, None, name, rop, prescale_factor, postscale_factor)
    start, count = _scatter_rows(tensor.shape[0], size(), rank())
    return Handle(
        [],
        lambda: full.wait().narrow(0, start, count).clone(),
        operation="reducescatter",
        name=name,
    )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = NoneCompressor,
    op: Any = Op.AVERAGE,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's block of rows of the reduction of ``tensor`` over all ranks."""
    if isinstance(compression, TorshCompression):
        raise ValueError("reducescatter takes Compression.none or Compression.fp16")
    compressed, ctx = compression.compress(tensor)
    out = synchronize(
        reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor)
    )
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = Op.AVERAGE,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start :func:`reducescatter` of each tensor; ``synchronize`` returns the list."""
    handles = [
        reducescatter_async(t, name, op, process_set, prescale_factor, postscale_factor)
        for t in tensors
    ]
    return Handle(
        [], lambda: [h.wait() for h in handles], operation="grouped_reducescatter", name=name
    )


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Any = NoneCompressor,
    op: Any = Op.AVERAGE,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor, in list order."""
    return [
        reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
        for t in tensors
    ]
