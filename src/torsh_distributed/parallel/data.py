"""Data parallelism: torch's DistributedDataParallel, applied as a function.

DDP's reducer (bucketing, overlap of all-reduce with backward) is torch's; this module only
decides when wrapping is meaningful and fixes the defaults we rely on.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["apply_ddp", "unwrap"]

_DDP_HAS_FORWARD_SYNC = (
    "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
)


def apply_ddp(
    model: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    broadcast_buffers: bool = False,
) -> nn.Module:
    """Wrap ``model`` in DDP over ``process_group`` (default: the world).

    Returns the model unchanged when there is no process group or a single rank, so callers need
    no special case for ``world_size == 1``.

    Args:
        model: Module whose parameters are already on this rank's device.
        process_group: Data-parallel group; ``None`` = the default group.
        bucket_cap_mb: Gradient bucket size; larger buckets mean fewer, larger all-reduces
            (better bandwidth, less overlap with backward).
        broadcast_buffers: Re-broadcast buffers from rank 0 every forward. Off: our models
            keep no running statistics, and it costs a collective per step.
    """
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return model
    device = next(model.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    # torch >= 2.13 renamed broadcast_buffers (deprecated, warns) to forward_sync_buffers.
    buffers_kw = "forward_sync_buffers" if _DDP_HAS_FORWARD_SYNC else "broadcast_buffers"
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        **{buffers_kw: broadcast_buffers},
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (or ``model`` itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
