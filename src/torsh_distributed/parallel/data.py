"""Data parallelism: torch's DistributedDataParallel, applied as a function.

DDP's reducer (bucketing, overlap of all-reduce with backward) is torch's; this module only
decides when wrapping is meaningful and fixes the defaults we rely on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from torsh_distributed.parallel.precision import LossScaler

__all__ = ["DDPOptions", "accumulate", "apply_ddp", "no_grad_sync", "unwrap"]

_DDP_HAS_FORWARD_SYNC = (
    "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DDPOptions:
    """DDP's wrapper options (see :func:`apply_ddp` for each trade-off); ``ParallelConfig``'s
    fields of the same names fill it in ``parallelize``."""

    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 0.0
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    init_sync: bool = True
    broadcast_buffers: bool = False


def apply_ddp(
    model: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    options: DDPOptions | None = None,
    bucket_cap_mb: float | None = None,
    broadcast_buffers: bool | None = None,
    first_bucket_mb: float | None = None,
    static_graph: bool | None = None,
    gradient_as_bucket_view: bool | None = None,
    find_unused_parameters: bool | None = None,
    init_sync: bool | None = None,
) -> nn.Module:
    """Wrap ``model`` in DDP over ``process_group`` (default: the world).

    Returns the model unchanged when there is no process group or a single rank, so callers need
    no special case for ``world_size == 1``. Options left ``None`` come from ``options``
    (default: :class:`DDPOptions`).

    Args:
        model: Module whose parameters are already on this rank's device.
        process_group: Data-parallel group; ``None`` = the default group.
        options: All wrapper options at once; the keyword arguments below override its fields.
        bucket_cap_mb: Gradient bucket size; larger buckets mean fewer, larger all-reduces
            (better bandwidth, less overlap with backward).
        broadcast_buffers: Re-broadcast buffers from rank 0 every forward. Off: our models
            keep no running statistics, and it costs a collective per step.
        first_bucket_mb: Size of the first bucket (gradients ready first); smaller starts the
            first all-reduce earlier. 0 = ``bucket_cap_mb``. The sizes then hold from the first
            step (without it the first backward uses one bucket of everything); either way DDP
            re-orders the buckets after its first backward, by gradient-ready order
            (:func:`~torsh_distributed.compression.hooks.prime_buckets` does it before a step).
        static_graph: The used parameters never change: DDP skips per-step bookkeeping.
        gradient_as_bucket_view: Gradients alias the buckets: one gradient copy less memory.
        find_unused_parameters: Search the graph for parameters without gradients every step
            (needed only when forward skips parameters; costs a traversal).
        init_sync: Broadcast rank 0's parameters and buffers at wrap time.
    """
    opts = options or DDPOptions()
    given = {
        "bucket_cap_mb": bucket_cap_mb, "broadcast_buffers": broadcast_buffers,
        "first_bucket_mb": first_bucket_mb, "static_graph": static_graph,
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "find_unused_parameters": find_unused_parameters, "init_sync": init_sync,
    }
    opts = replace(opts, **{k: v for k, v in given.items() if v is not None})
    bucket_cap_mb = opts.bucket_cap_mb
    if opts.first_bucket_mb < 0:
        raise ValueError(f"first_bucket_mb must be >= 0, got {opts.first_bucket_mb}")
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return model
    device = next(model.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    # torch >= 2.13 renamed broadcast_buffers (deprecated, warns) to forward_sync_buffers.
    buffers_kw = "forward_sync_buffers" if _DDP_HAS_FORWARD_SYNC else "broadcast_buffers"
    extra: dict[str, object] = {}
    if opts.first_bucket_mb and opts.first_bucket_mb != bucket_cap_mb:
        extra["bucket_cap_mb_list"] = [opts.first_bucket_mb, bucket_cap_mb]
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=opts.static_graph,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        find_unused_parameters=opts.find_unused_parameters,
        init_sync=opts.init_sync,
        **{buffers_kw: opts.broadcast_buffers},
        **extra,
    )


@contextmanager
def no_grad_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally, without exchanging them.

    DDP's ``no_sync()``; FSDP2 with ``set_requires_gradient_sync(False)`` (its gradients stay
    unsharded until the synchronising backward); a model that exchanges nothing is left alone.
    The first backward after the block exchanges the sum of everything accumulated.
    """
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (or ``model`` itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def accumulate(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    scaler: LossScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: int,
) -> torch.Tensor:
    """Forward/backward ``parts`` equal micro-batches, exchanging gradients only after the
    last; returns the mean loss (the loss of the whole batch)."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        raise ValueError(
            f"grad_accum {parts} splits the batch into micro-batches and needs tensor inputs "
            f"and targets, got {type(x).__name__} and {type(y).__name__}; use grad_accum 1"
        )
    total = torch.zeros((), device=x.device)
    for i, (xs, ys) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
        if i < parts - 1:
            with no_grad_sync(model):
                loss = loss_fn(model(xs), ys)
                scaler.backward(loss / parts)
        else:
            loss = loss_fn(model(xs), ys)
            scaler.backward(loss / parts)
        total += loss.detach()
    return total / parts
