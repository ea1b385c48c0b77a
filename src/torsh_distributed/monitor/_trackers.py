"""The step monitor's experiment trackers on rank 0 (private): started together, fed every
step's scalars in batches, ended together."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torsh_distributed.monitor.sinks import RunTracker

__all__ = ["TrackerSet"]


class TrackerSet:
    """The :class:`RunTracker` s among a monitor's sinks, and the steps not yet handed to them.

    Each step costs one list append: the loss, learning rate and gradient norm are kept as the
    loop passed them (0-d tensors too) and converted once per aggregation, so tracking adds no
    device synchronisation per step.
    """

    def __init__(self, trackers: Sequence[RunTracker]) -> None:
        self.trackers = list(trackers)
        self._records: list[tuple[int, Any, Any, Any]] = []

    def start(self) -> None:
        """Open every tracker's run (a bad location raises ``ValueError`` here)."""
        for tracker in self.trackers:
            tracker.start()

    def record(self, step: int, loss: Any, lr: Any, grad_norm: Any) -> None:
        """Keep step ``step``'s scalars until :meth:`flush` (hot path)."""
        self._records.append((step, loss, lr, grad_norm))

    def flush(self) -> None:
        """Hand the kept steps to every tracker (``train/loss``, ``train/lr``, ``train/grad_norm``;
        non-finite values left out)."""
        if not self._records:
            return
        records: list[tuple[int, Mapping[str, float]]] = []
        for step, loss, lr, grad_norm in self._records:
            values = {"train/loss": float(loss), "train/lr": float(lr)}
            if grad_norm is not None:
                values["train/grad_norm"] = float(grad_norm)
            records.append((step, {k: v for k, v in values.items() if math.isfinite(v)}))
        self._records = []
        for tracker in self.trackers:
            tracker.log_steps(records)

    def params(self, params: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_params(params)

    def metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        for tracker in self.trackers:
            tracker.log_steps([(step, values)])

    def summary(
        self, summary: Mapping[str, Any], *, step: int, name: str, artifacts: Sequence[str]
    ) -> None:
        for tracker in self.trackers:
            tracker.log_summary(summary, step=step, name=name, artifacts=artifacts)

    def owns(self, sink: object) -> bool:
        return any(sink is tracker for tracker in self.trackers)
