"""Checkpoints: verified (SHA-256), atomically committed, asynchronous, reshardable, safe to load.

:class:`CheckpointManager` is the API; :func:`verify` and :func:`scan` inspect directories (the
``torsh-dist checkpoint`` command); :class:`CheckpointConfig` is the trainer's section. See
docs/fault-tolerance.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
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

# On first use: the manager imports torch.distributed.checkpoint; the trainer's config and
# `torsh-dist checkpoint --help` do not need it.
__getattr__, __dir__ = exports(
    __name__,
    {
        "config": ("CheckpointConfig",),
        "manager": (
            "CheckpointInfo", "CheckpointManager", "LoadedCheckpoint", "latest_valid", "scan",
            "step_dir_name",
        ),
        "manifest": ("Verdict", "verify"),
    },
)
