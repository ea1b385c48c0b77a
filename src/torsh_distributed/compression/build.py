"""Build any compressor from its spec string, ``auto`` included.

``auto`` (:class:`~torsh_distributed.compression.adaptive.Adaptive`) chooses among fixed methods
that :func:`~torsh_distributed.compression.spec.build_fixed` builds, so this dispatch sits one
layer above both (no import cycle between the spec parser and ``auto``).
"""

from __future__ import annotations

from torsh_distributed.compression.adaptive import LADDER, LADDER_ZSTD, Adaptive
from torsh_distributed.compression.base import Compressor
from torsh_distributed.compression.spec import Spec, build_fixed, parse_spec

__all__ = ["build_compressor"]


def build_compressor(
    spec: str | Spec,
    *,
    error_feedback: bool | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> Compressor:
    """The compressor a spec names (see :func:`~torsh_distributed.compression.spec.build_fixed`
    for the arguments); ``auto`` gives the adaptive chooser, ``auto:zstd`` the chooser whose ladder
    also holds the gathered methods followed by the lossless stage (:data:`LADDER_ZSTD`).

    Raises:
        ValueError: invalid spec, or error feedback forced where it has no meaning.
    """
    parsed = parse_spec(spec) if isinstance(spec, str) else spec
    if parsed.kind == "auto":
        if error_feedback:
            raise ValueError(f"error_feedback does not apply to compression {parsed}")
        auto = Adaptive(ladder=LADDER if parsed.inner is None else LADDER_ZSTD, seed=seed)
        auto.name = str(parsed)  # auto or auto:zstd, as summaries and checkpoints name it
        return auto
    return build_fixed(
        parsed, error_feedback=error_feedback, stochastic_rounding=stochastic_rounding, seed=seed
    )
