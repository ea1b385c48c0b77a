"""Learning-rate scaling rule for a global batch that differs from the one the lr was tuned at.

Two rules are in use, and which one holds depends on the optimizer and on how far the batch moves:

* **linear** (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): multiply the lr by
  ``k = batch / reference``, with a gradual warm-up. It follows from SGD's update being a sum of
  per-sample gradients and held for SGD up to ``k = 32`` (8k images vs 256 on ImageNet), where
  it broke down without layer-wise adaptation (LARS, You et al. 2017).
* **square root** (Hoffer et al. 2017 for SGD beyond that range; Malladi et al. 2022, "On the
  SDEs and Scaling Rules for Adaptive Gradient Algorithms", for Adam): multiply by ``sqrt(k)``.
  Adam's update is normalised by the gradient's second moment, so its noise scale, not its
  step, grows with the batch: the SDE argument gives ``sqrt(k)``.

Either way a larger lr needs a warm-up: the same number of *samples* of warm-up as the reference
run (Goyal et al. keep 5 epochs at every batch size), i.e. fewer steps at a larger batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["LINEAR_LIMIT", "LRScaling", "RULES", "lr_scaling"]

RULES = ("auto", "linear", "sqrt")
"""``auto`` picks by optimizer and ratio (below); ``linear`` and ``sqrt`` force one rule."""

LINEAR_LIMIT = 32
"""Largest batch ratio for which the linear rule was shown to hold for SGD (Goyal et al.)."""


@dataclass(frozen=True, slots=True)
class LRScaling:
    """The recommended rule and what it gives."""

    rule: str
    """``none`` (same batch), ``linear`` or ``sqrt``."""
    ratio: float
    """``global_batch / reference_batch``."""
    factor: float
    """Multiply the reference lr by this."""
    lr: float | None
    """The scaled lr (``None`` when no reference lr was given)."""
    warmup_steps: int | None
    """Warm-up steps at the new batch: the reference warm-up's samples (``None`` when unknown)."""
    reason: str
    """Why this rule, in one or two sentences."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def lr_scaling(
    *,
    global_batch: int,
    reference_batch: int,
    optimizer: str = "adam",
    reference_lr: float | None = None,
    reference_warmup_steps: int = 0,
    rule: str = "auto",
) -> LRScaling:
    """Pick the lr scaling rule for ``global_batch`` from the batch ``reference_batch`` was tuned at.

    Args:
        global_batch: The new global batch (sequences per optimizer step).
        reference_batch: The batch at which ``reference_lr`` was tuned.
        optimizer: ``adam`` (square root at any ratio), or ``sgd``/``sgd-plain`` (linear up to
            :data:`LINEAR_LIMIT`, square root beyond).
        reference_lr: The tuned lr, to report the scaled one; ``None`` to report the factor only.
        reference_warmup_steps: Warm-up steps of the reference run (kept constant in samples).
        rule: ``auto`` (the choice above), or ``linear`` / ``sqrt`` to force one.
    """
    if rule not in RULES:
        raise ValueError(f"lr scaling rule must be one of {', '.join(RULES)}, got {rule!r}")
    if global_batch < 1:
        raise ValueError(f"--global-batch must be >= 1, got {global_batch}")
    if reference_batch < 1:
        raise ValueError(f"--ref-batch must be >= 1, got {reference_batch}")
    if reference_lr is not None and reference_lr <= 0:
        raise ValueError(f"--ref-lr must be > 0, got {reference_lr}")
    if reference_warmup_steps < 0:
        raise ValueError(f"--ref-warmup-steps must be >= 0, got {reference_warmup_steps}")
    ratio = global_batch / reference_batch
    if ratio == 1:
        rule, factor = "none", 1.0
        reason = "the global batch equals the reference batch: keep the tuned lr and warm-up"
    elif rule == "linear":
        factor = ratio
        reason = f"linear scaling, as asked: {ratio:g}x the reference batch"
    elif rule == "sqrt":
        factor = math.sqrt(ratio)
        reason = f"square-root scaling, as asked: {ratio:g}x the reference batch"
    elif optimizer == "adam":
        rule, factor = "sqrt", math.sqrt(ratio)
        reason = (
            f"Adam at {ratio:g}x the reference batch: square-root scaling (Malladi et al. 2022: "
            "Adam's update is normalised by the gradient's second moment, so only its noise "
            "scale moves with the batch)"
        )
    elif ratio <= LINEAR_LIMIT:
        rule, factor = "linear", ratio
        reason = (
            f"SGD at {ratio:g}x the reference batch (<= {LINEAR_LIMIT}x): linear scaling with "
            "warm-up (Goyal et al. 2017, shown to hold up to 32x)"
        )
    else:
        rule, factor = "sqrt", math.sqrt(ratio)
        reason = (
            f"SGD at {ratio:g}x the reference batch (> {LINEAR_LIMIT}x, beyond where Goyal et al. "
            "found the linear rule to hold): square-root scaling (Hoffer et al. 2017); consider "
            "a layer-wise adaptive optimizer (LARS/LAMB)"
        )
    warmup = None
    if reference_warmup_steps:
        warmup = max(1, math.ceil(reference_warmup_steps * reference_batch / global_batch))
    if rule != "none" and factor > 1:
        reason += (
            "; warm up over the reference run's warm-up samples"
            if warmup is not None
            else "; use a gradual warm-up (e.g. 5 epochs' worth of samples, Goyal et al.)"
        )
    lr = reference_lr * factor if reference_lr is not None else None
    return LRScaling(
        rule=rule, ratio=ratio, factor=factor, lr=lr, warmup_steps=warmup, reason=reason
    )
