"""Which committed checkpoints to keep: the newest N and the best K by a metric (lower is better)."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["to_delete"]


def to_delete(
    entries: Iterable[tuple[int, float | None]], *, keep_last: int, keep_best: int = 0
) -> set[int]:
    """Steps to delete among ``(step, metric)`` pairs of committed checkpoints.

    Args:
        entries: One pair per committed checkpoint; ``metric`` may be ``None`` (never "best").
        keep_last: Keep the newest this many; 0 keeps everything (nothing is deleted).
        keep_best: Also keep this many with the lowest finite metric.

    The newest checkpoint is always kept, whatever the arguments.
    """
    if keep_last < 0 or keep_best < 0:
        raise ValueError(f"keep_last and keep_best must be >= 0, got {keep_last}, {keep_best}")
    items = sorted(entries)
    if keep_last == 0 or not items:
        return set()
    keep = {step for step, _ in items[-keep_last:]}
    scored = [(m, s) for s, m in items if m is not None and math.isfinite(m)]
    keep |= {s for _, s in sorted(scored)[:keep_best]}
    keep.add(items[-1][0])
    return {step for step, _ in items} - keep
