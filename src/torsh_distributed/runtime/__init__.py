"""Runtime: init/shutdown, world info, environment detection, stores and errors.

Names are imported from their modules on first use (PEP 562): the errors and the environment
detection need no torch, and a command that only parses its flags should not wait for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.runtime.env import (
        ClusterEnvironment,
        MPIEnvironment,
        SlurmEnvironment,
        TorchrunEnvironment,
        WorldInfo,
        detect_environment,
    )
    from torsh_distributed.runtime.errors import (
        CheckpointError,
        CommunicationError,
        ConfigurationError,
        DistributedTimeoutError,
        FeatureNotAvailableError,
        ProcessFailureError,
        RankOutOfRangeError,
        TorshDistributedError,
    )
    from torsh_distributed.runtime.redis_store import RedisStore
    from torsh_distributed.runtime.stores import create_store
    from torsh_distributed.runtime.world import (
        Runtime,
        barrier,
        current,
        init,
        is_initialized,
        local_rank,
        local_world_size,
        node_rank,
        rank,
        shutdown,
        world_size,
    )

_WHERE = {
    "env": (
        "ClusterEnvironment", "MPIEnvironment", "SlurmEnvironment", "TorchrunEnvironment",
        "WorldInfo", "detect_environment",
    ),
    "errors": (
        "CheckpointError", "CommunicationError", "ConfigurationError", "DistributedTimeoutError",
        "FeatureNotAvailableError", "ProcessFailureError", "RankOutOfRangeError",
        "TorshDistributedError",
    ),
    "redis_store": ("RedisStore",),
    "stores": ("create_store",),
    "world": (
        "Runtime", "barrier", "current", "init", "is_initialized", "local_rank",
        "local_world_size", "node_rank", "rank", "shutdown", "world_size",
    ),
}

__all__ = [
    "CheckpointError",
    "ClusterEnvironment",
    "CommunicationError",
    "ConfigurationError",
    "DistributedTimeoutError",
    "FeatureNotAvailableError",
    "MPIEnvironment",
    "ProcessFailureError",
    "RankOutOfRangeError",
    "RedisStore",
    "Runtime",
    "SlurmEnvironment",
    "TorchrunEnvironment",
    "TorshDistributedError",
    "WorldInfo",
    "barrier",
    "create_store",
    "current",
    "detect_environment",
    "init",
    "is_initialized",
    "local_rank",
    "local_world_size",
    "node_rank",
    "rank",
    "shutdown",
    "world_size",
]


__getattr__, __dir__ = exports(__name__, _WHERE)
