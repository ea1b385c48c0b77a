"""Data for distributed training: world-size independent, resumable samplers for any map-style
dataset, and the built-in corpus (Python's own standard library source)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
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

# On first use: the samplers and the corpus import torch; the trainer's config needs only data.config.
__getattr__, __dir__ = exports(
    __name__,
    {
        "corpus": ("TokenWindows",),
        "sampler": (
            "DistributedBatchSampler", "EpochSampler", "GlobalSampler", "ReplacementSampler",
            "check_sampler_state", "fetch", "shard",
        ),
    },
)
