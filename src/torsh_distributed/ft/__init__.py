"""Fault-tolerant replica groups on torchft: a dead rank restarts only its group, which heals
from a live peer while the other groups keep stepping (docs/fault-tolerance.md)."""

from torsh_distributed.ft.config import FTConfig

__all__ = ["FTConfig"]
