"""The ``--compression`` spec: parse (torch-free, so the CLI validates fast) and build.

Grammar: ``none | fp16 | bf16 | int8 | natural | bimodal | topk:R | randomk:R | sketch:R |
threshold:T | sign | sign:vote | ternary | powersgd:RANK | ef21:<spec> | zstd:<spec> | auto |
auto:zstd``; ``R`` in (0, 1], ``T > 0``, ``RANK >= 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torsh_distributed.compression.base import Compressor

__all__ = ["Spec", "parse_spec", "build_fixed", "SPEC_HELP", "EF_DEFAULT"]

SPEC_HELP = (
    "none|fp16|bf16|int8|natural|bimodal|topk:R|randomk:R|sketch:R|threshold:T|sign|sign:vote|"
    "ternary|powersgd:RANK|ef21:<spec>|zstd:<spec>|auto|auto:zstd (R in (0, 1], T > 0, "
    "RANK >= 1; e.g. topk:0.01, powersgd:4, ef21:topk:0.01, zstd:int8)"
)

_PLAIN = ("none", "fp16", "bf16", "int8", "natural", "bimodal", "sign", "ternary", "auto")
_WITH_RATIO = ("topk", "randomk", "sketch")
# Methods that exchange through compress/exchange (one payload), so ef21 and zstd can wrap them.
_WRAPPABLE = (
    "none", "fp16", "bf16", "int8", "natural", "bimodal", "topk", "randomk", "threshold",
    "sign", "sign:vote", "ternary",
)
# Error feedback on by default where the method is biased and the literature uses it.
EF_DEFAULT = {
    "none": False,
    "fp16": False,
    "bf16": False,
    "int8": False,
    "natural": False,
    "bimodal": True,
    "sketch": True,
    "ternary": False,
    "topk": True,
    "randomk": True,
    "threshold": True,
    "sign": True,
    "sign:vote": False,
    "powersgd": True,
}


@dataclass(frozen=True, slots=True)
class Spec:
    """A parsed spec: ``kind`` (``topk``), its number (``0.01``) and, for ``ef21`` and ``zstd``,
    the inner spec (``auto:zstd`` is ``auto`` with ``inner = Spec("zstd")``)."""

    kind: str
    value: float = 0.0
    inner: Spec | None = None

    def __str__(self) -> str:
        if self.kind in ("ef21", "zstd") or (self.kind == "auto" and self.inner is not None):
            return f"{self.kind}:{self.inner}" if self.inner is not None else self.kind
        if self.kind in _WITH_RATIO or self.kind == "threshold":
            return f"{self.kind}:{self.value:g}"
        if self.kind == "powersgd":
            return f"powersgd:{int(self.value)}"
        return self.kind


def _number(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"compression spec {spec!r}: {text!r} is not a number; expected {SPEC_HELP}"
        ) from None


def parse_spec(spec: str) -> Spec:
    """Parse and validate a spec string.

    Raises:
        ValueError: unknown method, missing or out-of-range number; the message lists the grammar.
    """
    text = spec.strip().lower()
    if text in _PLAIN or text == "sign:vote":
        return Spec(text)
    if text == "auto:zstd":
        return Spec("auto", inner=Spec("zstd"))
    kind, sep, rest = text.partition(":")
    if not sep or not rest:
        if kind in _WITH_RATIO or kind in ("threshold", "powersgd", "ef21", "zstd"):
            raise ValueError(
                f"compression spec {spec!r}: {kind} needs a value, e.g. {kind}:"
                f"{'4' if kind == 'powersgd' else 'int8' if kind == 'zstd' else 'topk:0.01' if kind == 'ef21' else '0.01'}"
            )
        raise ValueError(f"unknown compression spec {spec!r}; expected {SPEC_HELP}")
    if kind in _WITH_RATIO:
        ratio = _number(rest, spec)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(
                f"compression spec {spec!r}: {kind} ratio must be in (0, 1], got {ratio:g}"
            )
        return Spec(kind, ratio)
    if kind == "threshold":
        value = _number(rest, spec)
        if not value > 0:
            raise ValueError(f"compression spec {spec!r}: threshold must be > 0, got {value:g}")
        return Spec(kind, value)
    if kind == "powersgd":
        value = _number(rest, spec)
        if value != int(value) or value < 1:
            raise ValueError(f"compression spec {spec!r}: powersgd rank must be an integer >= 1")
        return Spec(kind, int(value))
    if kind == "ef21":
        inner = parse_spec(rest)
        if inner.kind == "none" or inner.kind not in _WRAPPABLE:
            raise ValueError(
                f"compression spec {spec!r}: ef21 wraps a compressor of "
                f"{'|'.join(k for k in _WRAPPABLE if k not in ('none', 'sign:vote'))}, "
                f"not {inner.kind}"
            )
        return Spec("ef21", inner=inner)
    if kind == "zstd":
        inner = parse_spec(rest)
        if inner.kind not in _WRAPPABLE:
            raise ValueError(
                f"compression spec {spec!r}: zstd (lossless) stacks after a method that sends "
                f"one payload, {'|'.join(_WRAPPABLE)}; not {inner.kind} (PowerSGD, EF21, sketch "
                "and auto run their own rounds; auto:zstd lets auto stack it)"
            )
        return Spec("zstd", inner=inner)
    raise ValueError(f"unknown compression spec {spec!r}; expected {SPEC_HELP}")


def _base(spec: Spec, *, stochastic_rounding: bool, seed: int) -> Compressor:
    import torch

    from torsh_distributed.compression import (
        bimodal,
        natural,
        powersgd,
        quantize,
        sign,
        sketch,
        sparsify,
    )
    from torsh_distributed.compression.base import Identity

    kind = spec.kind
    if kind == "none":
        return Identity()
    if kind in ("fp16", "bf16"):
        return quantize.Cast(torch.float16 if kind == "fp16" else torch.bfloat16)
    if kind == "int8":
        return quantize.Int8(stochastic=stochastic_rounding, seed=seed)
    if kind == "natural":
        return natural.Natural(seed=seed)
    if kind == "bimodal":
        return bimodal.Bimodal()
    if kind == "sketch":
        return sketch.CountSketch(spec.value, seed=seed)
    if kind == "topk":
        return sparsify.TopK(spec.value)
    if kind == "randomk":
        return sparsify.RandomK(spec.value, seed=seed)
    if kind == "threshold":
        return sparsify.Threshold(spec.value)
    if kind in ("sign", "sign:vote"):
        return sign.SignSGD(vote=kind == "sign:vote")
    if kind == "ternary":
        return sign.Ternary(seed=seed)
    assert kind == "powersgd", kind
    return powersgd.PowerSGD(int(spec.value), seed=seed)


def build_fixed(
    spec: str | Spec,
    *,
    error_feedback: bool | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Compressor:
    """The fixed (non-``auto``) compressor a spec names, with error feedback as requested.

    ``auto`` chooses among fixed methods built here, so it lives one layer up
    (:func:`torsh_distributed.compression.build.build_compressor` builds every spec).

    Args:
        spec: Spec string or parsed :class:`Spec`.
        error_feedback: ``None`` = the method's default (:data:`EF_DEFAULT`); ``True``/``False``
            forces it (PowerSGD's own residual; ignored with a ``ValueError`` for ef21/auto/none,
            which have none to toggle).
        stochastic_rounding: int8 rounds stochastically (unbiased).
        seed: Seed of every random choice; equal on all ranks.

    Raises:
        ValueError: invalid spec, or error feedback forced where it has no meaning.
    """
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind in ("none", "auto", "ef21") and error_feedback:
        raise ValueError(f"error_feedback does not apply to compression {parsed}")
    if parsed.kind == "auto":
        raise ValueError(
            "build_fixed builds fixed methods; 'auto' is built by "
            "torsh_distributed.compression.build.build_compressor"
        )
    if parsed.kind == "zstd":
        from torsh_distributed.compression.lossless import Zstd

        assert parsed.inner is not None
        inner = build_fixed(
            parsed.inner,
            error_feedback=error_feedback,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
        )
        return Zstd(inner)
    if parsed.kind == "ef21":
        from torsh_distributed.compression.ef21 import EF21

        assert parsed.inner is not None
        return EF21(_base(parsed.inner, stochastic_rounding=stochastic_rounding, seed=seed))
    ef = EF_DEFAULT[parsed.kind] if error_feedback is None else error_feedback
    comp = _base(parsed, stochastic_rounding=stochastic_rounding, seed=seed)
    if parsed.kind in ("powersgd", "sketch"):
        comp.error_feedback = ef  # type: ignore[attr-defined]
        return comp
    if ef and parsed.kind != "none":
        from torsh_distributed.compression.base import ErrorFeedback

        return ErrorFeedback(comp)
    return comp
