"""Coalesced all-reduce of many small tensors: flatten into buckets, one collective per bucket.

Many tiny all-reduces pay the per-message latency (alpha) each time; packing them into buckets of
``bucket_bytes`` pays it once per bucket at the price of a copy in and out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["buckets", "bucketed_all_reduce"]


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype/device into buckets of at most ``bucket_bytes``.

    A tensor bigger than the cap gets a bucket of its own. Order inside a dtype is kept.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    out: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        size = t.numel() * t.element_size()
        current, used = open_.get(key, ([], 0))
        if current and used + size > bucket_bytes:
            out.append(current)
            current, used = [], 0
        current.append(i)
        open_[key] = (current, used + size)
    out.extend(b for b, _ in open_.values() if b)
    return out


def bucketed_all_reduce(
    tensors: Sequence[torch.Tensor],
    reduce_flat: Callable[[torch.Tensor], object],
    *,
    bucket_bytes: int = 4 << 20,
) -> list[torch.Tensor]:
    """All-reduce every tensor in place through ``reduce_flat(flat_bucket)``, one call per bucket."""
    for idx in buckets(tensors, bucket_bytes):
        group = [tensors[i] for i in idx]
        flat = _flatten_dense_tensors(group)
        reduce_flat(flat)
        for dst, src in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            dst.copy_(src)
    return list(tensors)
