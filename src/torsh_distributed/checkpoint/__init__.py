"""Checkpoints: verified (SHA-256), atomically committed, asynchronous, reshardable, safe to load.

:class:`CheckpointManager` is the API; :func:`verify` and :func:`scan` inspect directories (the
``torsh-dist checkpoint`` command); :class:`CheckpointConfig` is the trainer's section. See
docs/fault-tolerance.md.
"""

from torsh_distributed.checkpoint.config import CheckpointConfig
from torsh_distributed.checkpoint.manager import (
    CheckpointInfo,
    CheckpointManager,
    LoadedCheckpoint,
    latest_valid,
    scan,
    step_dir_name,
)
from torsh_distributed.checkpoint.manifest import Verdict, verify

__all__ = [
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointManager",
    "LoadedCheckpoint",
    "Verdict",
    "latest_valid",
    "scan",
    "step_dir_name",
    "verify",
]
