"""Anomaly detection: z-score of each new value against a sliding window of the previous ones."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Anomaly", "ZScoreDetector", "AnomalyTracker"]


@dataclass(frozen=True, slots=True)
class Anomaly:
    """A value that lies ``z`` standard deviations from the mean of the window before it."""

    metric: str
    step: int
    value: float
    mean: float
    std: float
    z: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{self.metric} = {self.value:.4g} at step {self.step} is {self.z:+.1f} sigma from "
            f"its recent mean {self.mean:.4g}"
        )


class ZScoreDetector:
    """Flags values whose |z| against the last ``window`` values is at least ``threshold``.

    A flagged value is not added to the window, so one spike does not mask the next; values
    within ``rel_floor`` of the mean are never flagged (a perfectly flat series has std 0).

    Args:
        window: Values remembered; larger = steadier baseline, slower to follow real drifts.
        threshold: |z| that counts as an anomaly; 3 flags ~0.3 % of Gaussian noise, 4 far fewer.
        min_samples: Values needed before anything is flagged (the baseline must exist first).
        rel_floor: Relative deviation below which nothing is flagged (guards near-constant series).
    """

    def __init__(
        self, *, window: int = 50, threshold: float = 3.0, min_samples: int = 8, rel_floor: float = 0.05
    ) -> None:
        if window < 3:
            raise ValueError(f"window must be >= 3, got {window}")
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        if not 2 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [2, window={window}], got {min_samples}")
        self.threshold = threshold
        self.min_samples = min_samples
        self.rel_floor = rel_floor
        self._values: deque[float] = deque(maxlen=window)

    def score(self, value: float) -> tuple[float, float, float]:
        """``(z, mean, std)`` of ``value`` against the window (z = 0 while too few values)."""
        n = len(self._values)
        if n < self.min_samples:
            return 0.0, math.nan, math.nan
        mean = sum(self._values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self._values) / (n - 1))
        if abs(value - mean) <= self.rel_floor * abs(mean):
            return 0.0, mean, std
        if std == 0.0:
            return math.copysign(math.inf, value - mean), mean, std
        return (value - mean) / std, mean, std

    def update(self, value: float, *, metric: str = "value", step: int = 0) -> Anomaly | None:
        """Score ``value``; return an :class:`Anomaly` if flagged, else remember it and return None."""
        if not math.isfinite(value):
            return Anomaly(metric, step, value, math.nan, math.nan, math.inf)
        z, mean, std = self.score(value)
        if abs(z) >= self.threshold:
            return Anomaly(metric, step, value, mean, std, z)
        self._values.append(value)
        return None


class AnomalyTracker:
    """One :class:`ZScoreDetector` per metric name; keeps every anomaly found (bounded)."""

    def __init__(self, metrics: tuple[str, ...], *, window: int = 50, threshold: float = 3.0,
                 max_kept: int = 200) -> None:
        self._detectors = {
            m: ZScoreDetector(window=window, threshold=threshold, min_samples=min(8, window))
            for m in metrics
        }
        self.found: deque[Anomaly] = deque(maxlen=max_kept)

    def update(self, values: dict[str, float], *, step: int) -> list[Anomaly]:
        """Feed the tracked metrics present in ``values``; return the new anomalies."""
        new = []
        for name, detector in self._detectors.items():
            if name in values:
                anomaly = detector.update(values[name], metric=name, step=step)
                if anomaly is not None:
                    new.append(anomaly)
        self.found.extend(new)
        return new
