"""The trainer's ``compression`` section: the method and the DDP wrapper's options.

Torch-free, so that building and validating configs (the CLI) stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torsh_distributed.compression.spec import parse_spec

__all__ = ["CompressionConfig"]


@dataclass(kw_only=True, slots=True)
class CompressionConfig:
    """Gradient compression of data parallelism (DDP, ``zero_stage`` 0) and DDP's options."""

    method: str = field(default="none", metadata={"flags": ["--compression"]})
    """none|fp16|bf16|int8|topk:R|randomk:R|threshold:T|sign|sign:vote|ternary|powersgd:RANK|
    ef21:<spec>|auto. Lossy methods trade bytes on the wire for gradient error; biased ones
    (topk, randomk, threshold, sign, powersgd) use error feedback by default; ``auto`` picks
    per bucket from measured bandwidth and compute time. See docs/compression.md."""
    error_feedback: str = field(default="default", metadata={"flags": ["--error-feedback"]})
    """``default`` (on for topk, randomk, threshold, sign, powersgd), ``on`` or ``off``:
    accumulate what was not sent and add it to the next gradient."""
    warmup_steps: int = field(default=0, metadata={"flags": ["--compression-warmup"]})
    """Exchange uncompressed gradients for the first N steps, then compress (torch's
    ``start_powerSGD_iter``; DGC's warm-up). 0 = compress from the first step."""
    stochastic_rounding: bool = field(
        default=False, metadata={"negatable": True, "flags": ["--stochastic-rounding"]}
    )
    """int8 rounds stochastically: unbiased, about twice the error of round-to-nearest."""
    bucket_cap_mb: float = field(default=25.0, metadata={"flags": ["--bucket-cap-mb"]})
    """DDP gradient bucket size in MiB: larger = fewer, larger exchanges (better bandwidth, less
    overlap with backward). Compression works per bucket."""
    first_bucket_mb: float = field(default=0.0, metadata={"flags": ["--first-bucket-mb"]})
    """Size of the first bucket (the last layers' gradients, ready first); a small one starts
    communication earlier. 0 = the same as ``bucket_cap_mb``."""
    static_graph: bool = field(
        default=False, metadata={"negatable": True, "flags": ["--static-graph"]}
    )
    """Tell DDP the set of used parameters never changes: enables its static-graph optimisations."""
    gradient_as_bucket_view: bool = field(
        default=False, metadata={"negatable": True, "flags": ["--gradient-as-bucket-view"]}
    )
    """Gradients are views into DDP's buckets: saves one gradient copy of memory and a copy per step."""
    find_unused_parameters: bool = field(
        default=False, metadata={"negatable": True, "flags": ["--find-unused-parameters"]}
    )
    """Traverse the graph each step to find parameters without gradients (costs time; needed
    only when some parameters are skipped in forward)."""
    init_sync: bool = field(default=True, metadata={"negatable": True, "flags": ["--init-sync"]})
    """Broadcast rank 0's parameters when DDP wraps the model (ranks start identical anyway
    from the shared seed; keep on unless startup time matters)."""

    def __post_init__(self) -> None:
        try:
            parse_spec(self.method)
        except ValueError as exc:
            raise ValueError(f"compression.method: {exc}") from None
        if self.error_feedback not in ("default", "on", "off"):
            raise ValueError(
                f"compression.error_feedback must be default, on or off; got {self.error_feedback!r}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"compression.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"compression.bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.first_bucket_mb < 0:
            raise ValueError(
                f"compression.first_bucket_mb must be >= 0, got {self.first_bucket_mb}"
            )

    @property
    def enabled(self) -> bool:
        return parse_spec(self.method).kind != "none"

    @property
    def ef(self) -> bool | None:
        return {"default": None, "on": True, "off": False}[self.error_feedback]
