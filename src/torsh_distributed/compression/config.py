"""The ``compression`` configuration section: the method, error feedback, warm-up.

Torch-free, so that building and validating configs (the CLI) stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torsh_distributed.compression.spec import parse_spec

__all__ = ["CompressionConfig"]


@dataclass(kw_only=True, slots=True)
class CompressionConfig:
    """Compression of the data-parallel exchange: DDP's gradients (``zero_stage`` 0), or FSDP2's
    parameter all-gather and gradient reduce-scatter (``zero_stage`` 2 or 3, ``int8`` only)."""

    method: str = field(default="none", metadata={"flags": ["--compression"]})
    """none|fp16|bf16|int8|natural|bimodal|topk:R|randomk:R|sketch:R|threshold:T|sign|sign:vote|
    ternary|powersgd:RANK|ef21:<spec>|zstd:<spec>|auto|auto:zstd. Lossy methods trade bytes on
    the wire for gradient error; biased ones (topk, randomk, sketch, threshold, sign, bimodal,
    powersgd) use error feedback by default; ``zstd:<spec>`` adds a lossless stage after a method;
    ``auto`` picks per bucket from measured bandwidth and compute time. With ``--zero-stage 2|3``
    only ``int8`` applies: block-quantised FSDP2 parameter all-gather and gradient reduce-scatter
    (ZeRO++'s qwZ/qgZ, 3.9x fewer bytes). See docs/compression.md."""
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

    @property
    def enabled(self) -> bool:
        return parse_spec(self.method).kind != "none"

    @property
    def ef(self) -> bool | None:
        return {"default": None, "on": True, "off": False}[self.error_feedback]
