"""Data for distributed training: world-size independent, resumable samplers for any map-style
dataset, and the built-in corpus (Python's own standard library source)."""

from __future__ import annotations

from torsh_distributed.data.corpus import TokenWindows
from torsh_distributed.data.sampler import (
    DistributedBatchSampler,
    EpochSampler,
    GlobalSampler,
    ReplacementSampler,
    check_sampler_state,
    fetch,
    shard,
)

__all__ = [
    "GlobalSampler",
    "EpochSampler",
    "ReplacementSampler",
    "DistributedBatchSampler",
    "shard",
    "fetch",
    "check_sampler_state",
    "TokenWindows",
]
