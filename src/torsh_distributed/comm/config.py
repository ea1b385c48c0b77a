"""The ``comm`` configuration section: gradient all-reduce algorithm, traces, debug mode (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CommConfig", "ALGORITHM_NAMES"]

ALGORITHM_NAMES = ("torch", "ring", "tree", "hierarchical", "auto")
"""The facade's all-reduce algorithms (``comm.algorithms.ALGORITHMS`` holds their implementations)."""


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

    def __post_init__(self) -> None:
        if self.algorithm and self.algorithm not in ALGORITHM_NAMES:
            raise ValueError(
                f"comm.algorithm must be empty or one of {', '.join(ALGORITHM_NAMES)}, got {self.algorithm!r}"
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

