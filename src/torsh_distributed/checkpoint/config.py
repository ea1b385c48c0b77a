"""The ``checkpoint`` section of the trainer's configuration (``--checkpoint-dir`` and friends)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CheckpointConfig"]


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and where the trainer checkpoints, how many it keeps and what it resumes from."""

    dir: str = field(default="", metadata={"flags": ["--checkpoint-dir"]})
    """Directory of the checkpoints (``step_00000010/`` ...); empty = no checkpointing at all."""
    every: int = field(default=0, metadata={"flags": ["--checkpoint-every"]})
    """Save every N optimizer steps; 0 = not by steps. A kill redoes at most this many steps."""
    every_s: float = field(default=0.0, metadata={"flags": ["--checkpoint-every-s"]})
    """Save when this many seconds passed since the last save (rank 0's clock decides); 0 = off."""
    keep_last: int = field(default=3, metadata={"flags": ["--keep-last"]})
    """Keep the newest N committed checkpoints (older ones are deleted); 0 = keep all."""
    keep_best: int = field(default=0, metadata={"flags": ["--keep-best"]})
    """Also keep the N checkpoints with the lowest training loss (mean of the last 10 steps)."""
    async_save: bool = field(
        default=True, metadata={"flags": ["--async-checkpoint"], "negatable": True}
    )
    """Write in the background (training waits only for the in-memory snapshot)."""
    resume: str = field(default="auto", metadata={"flags": ["--resume"]})
    """``auto`` (newest valid checkpoint in ``dir``, if any), ``never``, or a checkpoint path."""
    save_final: bool = field(default=True, metadata={"negatable": True})
    """Save a checkpoint after the last step (when ``dir`` is set)."""
    peer_replicas: int = 0
    """0: ``dir`` is one file system every rank sees (one host, or a shared mount). k >= 1: each
    host keeps its own local ``dir`` and every rank's files are also copied to k other hosts in
    the background after each save (SHA-256 verified), so a resume survives losing up to k hosts'
    directories; needs k + 1 hosts, costs k x each rank's shard bytes on network and disk."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0 steps, got {self.every}")
        if self.every_s < 0:
            raise ValueError(f"checkpoint.every_s must be >= 0 seconds, got {self.every_s}")
        if self.keep_last < 0:
            raise ValueError(
                f"checkpoint.keep_last must be >= 0 (0 = keep all), got {self.keep_last}"
            )
        if self.keep_best < 0:
            raise ValueError(f"checkpoint.keep_best must be >= 0, got {self.keep_best}")
        if not self.resume:
            raise ValueError("checkpoint.resume must be auto, never or a checkpoint path; got ''")
        if self.peer_replicas < 0:
            raise ValueError(f"checkpoint.peer_replicas must be >= 0, got {self.peer_replicas}")
        if self.peer_replicas and not self.dir:
            raise ValueError("checkpoint.peer_replicas needs checkpoint.dir (--checkpoint-dir DIR)")
        if self.peer_replicas and self.keep_last == 1:
            raise ValueError(
                "checkpoint.keep_last must be 0 or >= 2 with checkpoint.peer_replicas: hosts "
                "commit one after another, so the newest step may be incomplete after a kill "
                "and the previous one must still be there"
            )
        if (self.every or self.every_s) and not self.dir:
            raise ValueError(
                "checkpoint.every / checkpoint.every_s need checkpoint.dir (--checkpoint-dir DIR)"
            )

    @property
    def enabled(self) -> bool:
        """True when a checkpoint directory is set."""
        return bool(self.dir)
