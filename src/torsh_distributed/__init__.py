"""torsh-distributed: distributed training and inference of PyTorch models.

The public API is small: start a job with :func:`init`, ask where you are with :func:`rank` and
friends, stop with :func:`shutdown`. Submodules hold the rest: ``runtime`` (stores, errors),
``testing`` (multi-rank harness), ``train`` (the built-in trainer), ``cli`` (``torsh-dist``).

The names are resolved on first use (PEP 562): ``import torsh_distributed`` imports no torch, so
``torsh-dist --help`` and its refusals of bad input print without waiting for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.runtime import (
        CheckpointError,
        CommunicationError,
        ConfigurationError,
        DistributedTimeoutError,
        FeatureNotAvailableError,
        ProcessFailureError,
        RankOutOfRangeError,
        RedisStore,
        Runtime,
        TorshDistributedError,
        WorldInfo,
        barrier,
        create_store,
        init,
        is_initialized,
        local_rank,
        local_world_size,
        node_rank,
        rank,
        shutdown,
        world_size,
    )

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CommunicationError",
    "ConfigurationError",
    "DistributedTimeoutError",
    "FeatureNotAvailableError",
    "ProcessFailureError",
    "RankOutOfRangeError",
    "RedisStore",
    "Runtime",
    "TorshDistributedError",
    "WorldInfo",
    "__version__",
    "barrier",
    "create_store",
    "init",
    "is_initialized",
    "local_rank",
    "local_world_size",
    "node_rank",
    "rank",
    "shutdown",
    "world_size",
]


__getattr__, __dir__ = exports(__name__, {"runtime": [n for n in __all__ if n != "__version__"]})
