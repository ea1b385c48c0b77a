"""The ``comm`` configuration section: gradient all-reduce algorithm, traces, debug mode (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CommConfig", "ALGORITHM_NAMES", "SCHEDULES"]

ALGORITHM_NAMES = ("torch", "ring", "tree", "hierarchical", "auto")
"""The facade's all-reduce algorithms (``comm.algorithms.ALGORITHMS`` holds their implementations)."""
SCHEDULES = ("fifo", "priority")
"""Orders of the data-parallel gradient exchange (docs/communication.md, "Scheduling")."""


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """Communication of the trainer (all defaults keep DDP's built-in behaviour)."""

    algorithm: str = field(default="", metadata={"flags": ["--comm-algorithm"]})
    """Gradient all-reduce through the facade with this algorithm: torch, ring, tree,
    hierarchical or auto; empty = DDP's own all-reduce (no hook)."""
    trace: str = field(default="", metadata={"flags": ["--trace"]})
    """Record every facade collective; rank 0 writes one merged Chrome trace (Perfetto) here."""
    debug: bool = field(default=False, metadata={"flags": ["--comm-debug"], "negatable": True})
    """Fingerprint every facade collective in the store: mismatches raise, hangs name the missing ranks."""
    debug_timeout: float = 60.0
    """Seconds a debug-mode collective waits for the other ranks before the "never arrived" report."""
    node_assignment: str = ""
    """Node id per rank (``0,0,1,1``) for hierarchical/auto; empty = host names."""
    exchange_schedule: str = field(default="fifo", metadata={"flags": ["--comm-schedule"]})
    """Order of the data-parallel gradient exchange: ``fifo`` (DDP's buckets in the order
    backward produces them; the optimizer steps after all of them) or ``priority`` (gradients
    cut into ``partition_kb`` chunks, sent first-layer-first with ``credit_kb`` in flight; each
    chunk's parameters are updated when it arrives and the next forward waits per module only
    for its own parameters). Bit-identical results; plain DDP or ZeRO-2 (``--zero-stage 0|2``; at 2
    each chunk is reduce-scattered, the shard stepped and the chunk all-gathered, with no grad
    clipping or checkpoints); no tp/pp/ep, compression or 1-bit optimizer."""
    partition_kb: int = 0
    """``priority``: chunk size in KiB (tensors are cut and merged into chunks of this size);
    0 = auto: 512 KiB, then chosen from the measured link after 3 steps (logged); ZeRO-2: 1 MiB,
    kept."""
    credit_kb: int = 0
    """``priority``: KiB of chunks in flight at once (smaller lets a first-layer chunk overtake
    sooner, larger keeps a high-latency link busy); 0 = auto: two partitions, then at least the
    measured bandwidth-delay product."""

    def __post_init__(self) -> None:
        if self.algorithm and self.algorithm not in ALGORITHM_NAMES:
            raise ValueError(
                f"comm.algorithm must be empty or one of {', '.join(ALGORITHM_NAMES)}, got {self.algorithm!r}"
            )
        if self.exchange_schedule not in SCHEDULES:
            raise ValueError(
                f"--comm-schedule must be one of {', '.join(SCHEDULES)}, "
                f"got {self.exchange_schedule!r}"
            )
        for name in ("partition_kb", "credit_kb"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"comm.{name} must be >= 0 (0 = auto), got {value}")
            if value and self.exchange_schedule != "priority":
                raise ValueError(f"comm.{name} applies to --comm-schedule priority only")
        if self.credit_kb and self.partition_kb and self.credit_kb < self.partition_kb:
            raise ValueError(
                f"comm.credit_kb ({self.credit_kb}) must be >= comm.partition_kb "
                f"({self.partition_kb}): one chunk must fit in flight"
            )
        if self.debug_timeout <= 0:
            raise ValueError(f"comm.debug_timeout must be > 0, got {self.debug_timeout}")
        if self.node_assignment:
            try:
                [int(x) for x in self.node_assignment.split(",")]
            except ValueError:
                raise ValueError(
                    f"comm.node_assignment must be comma-separated ints like 0,0,1,1, got {self.node_assignment!r}"
                ) from None
