"""Runtime: init/shutdown, world info, environment detection, stores and errors."""

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
