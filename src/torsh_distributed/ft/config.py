"""The ``ft`` section: fault-tolerant replica groups (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torsh_distributed._checks import positive as _positive

__all__ = ["LIGHTHOUSES", "FTConfig"]

LIGHTHOUSES = ("launcher", "torchft")


@dataclass(kw_only=True, slots=True)
class FTConfig:
    """Replica groups: the data-parallel ranks split into groups that fail and heal alone.

    With ``replica_groups`` R > 1 the job's ranks form R groups of equal size (each runs DDP or
    ZeRO inside); the groups average their gradients through torchft's fault-tolerant all-reduce.
    A dead rank restarts only its own group, which then takes the live state from a healthy
    group over the network (docs/fault-tolerance.md, "Replica groups").
    """

    replica_groups: int = field(default=1, metadata={"flags": []})
    """Number of replica groups R (1 = off: a dead rank restarts every rank). The ranks
    (``--nproc-per-node``) must be a multiple of R; batch_size a multiple of R times a group's
    data-parallel ranks."""
    max_restarts: int = field(default=3, metadata={"flags": []})
    """Restarts of one group before it is given up (the job then goes on without it while
    ``min_groups`` groups remain)."""
    backoff_s: float = field(default=0.5, metadata={"flags": []})
    """Wait before a group's first restart, doubled at each further restart of that group (a
    group that keeps failing then restarts less often). It also keeps the restarted group's
    start-up off the CPU while the healthy groups form their quorum without it: 0.1 s gave a
    1.6-step stall on the loaded 2-core VM where 0.5 s gave 0.1-1.34 steps (<= 1 in 6 of 8)."""
    min_groups: int = field(default=1, metadata={"flags": []})
    """The job stops with an error when fewer groups than this are left (given up, or all
    down at once: nothing healthy to heal from)."""
    heartbeat_timeout_s: float = field(default=1.0, metadata={"flags": []})
    """A group silent this long leaves the quorum. With ``lighthouse`` ``launcher`` this is only
    the fallback for a failure the launcher cannot see (a hung process: a dead one leaves at
    once); with ``torchft`` the healthy groups' stall after a kill is about this long. Too low on
    a loaded host evicts live groups (they then heal and rejoin: slower, still correct)."""
    lighthouse: str = field(default="launcher", metadata={"flags": []})
    """The quorum service: ``launcher`` (torchft's rules, in the launcher, which drops a group
    the moment it sees its processes die: the healthy groups stall about one quorum round) or
    ``torchft`` (torchft's own lighthouse: a dead group leaves after ``heartbeat_timeout_s``)."""
    spare_group: bool = field(default=True, metadata={"flags": []})
    """With ``--start-method spawn`` only: keep one group's worth of ranks started and imported
    (torch, torchft, the engine), waiting: a restarted group takes them instead of fresh
    processes, which saves the interpreter start-up and imports (most of a rejoin). Costs that
    many idle processes' memory (~0.4 GB each with torch) and their imports' CPU once, after the
    job is up and again after each restart. With ``forkserver`` (the default) every rank forks
    from the warm forkserver and is past its imports at once: no spare is started."""
    timeout_s: float = field(default=30.0, metadata={"flags": []})
    """Timeout of the cross-group all-reduce, the commit vote and the state transfer."""

    def __post_init__(self) -> None:
        for name in ("replica_groups", "min_groups"):
            _positive("ft", name, getattr(self, name))
        if self.max_restarts < 0:
            raise ValueError(f"ft.max_restarts must be >= 0, got {self.max_restarts}")
        if self.backoff_s < 0:
            raise ValueError(f"ft.backoff_s must be >= 0, got {self.backoff_s}")
        _positive("ft", "heartbeat_timeout_s", self.heartbeat_timeout_s)
        _positive("ft", "timeout_s", self.timeout_s)
        if self.lighthouse not in LIGHTHOUSES:
            raise ValueError(
                f"ft.lighthouse must be one of {', '.join(LIGHTHOUSES)}, got {self.lighthouse!r}"
            )
        if self.min_groups > self.replica_groups:
            raise ValueError(
                f"ft.min_groups ({self.min_groups}) cannot exceed ft.replica_groups "
                f"({self.replica_groups})"
            )

    @property
    def enabled(self) -> bool:
        return self.replica_groups > 1

    def check_nproc(self, nproc: int) -> int:
        """The ranks of one group (the world its parallel degrees split); ``ValueError`` unless
        ``nproc`` ranks split into :attr:`replica_groups` equal groups."""
        if nproc % self.replica_groups:
            raise ValueError(
                f"--nproc-per-node {nproc} is not a multiple of ft.replica_groups {self.replica_groups}"
            )
        return nproc // self.replica_groups

    def check_batch(self, batch_size: int, *, data_ranks: int, grad_accum: int = 1) -> int:
        """Each rank's batch: ``batch_size`` split over the groups, then over the ``data_ranks``
        of a group (its data-parallel ranks; TP ranks share theirs), then into ``grad_accum``
        micro-batches; ``ValueError`` naming what does not divide."""
        ranks = self.replica_groups * data_ranks
        if batch_size % ranks:
            raise ValueError(
                f"batch_size {batch_size} is not divisible by the {ranks} data-parallel ranks of "
                f"{self.replica_groups} replica groups; choose a multiple of {ranks}"
            )
        per_rank = batch_size // ranks
        if per_rank % grad_accum:
            raise ValueError(
                f"grad_accum {grad_accum} must divide the per-rank batch {per_rank} (batch_size "
                f"{batch_size} / {ranks} data-parallel ranks of {self.replica_groups} groups)"
            )
        return per_rank
