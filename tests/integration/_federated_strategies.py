"""A user's own Flower strategy for the federated tests (``--strategy FILE:trimmed_mean``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg


def trimmed(states: list[dict[str, torch.Tensor]], trim: int) -> dict[str, torch.Tensor]:
    """Coordinate-wise mean after dropping the ``trim`` smallest and largest values."""
    out = {}
    for name, first in states[0].items():
        stacked = torch.stack([s[name].double() for s in states]).sort(dim=0).values
        out[name] = stacked[trim : len(states) - trim].mean(dim=0).to(first.dtype)
    return out


class TrimmedMean(FedAvg):
    """FedAvg's sampling and evaluation, with a coordinate-wise trimmed mean (robust to outliers)."""

    def __init__(self, *, trim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trim = trim

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        states = [m.content["arrays"].to_torch_state_dict() for m in replies if not m.has_error()]
        if len(states) <= 2 * self.trim:
            return None, None
        return ArrayRecord(trimmed(states, self.trim)), MetricRecord({"aggregated": len(states)})


def trimmed_mean(
    fraction_train: float, fraction_evaluate: float, min_train_nodes: int, min_evaluate_nodes: int,
    min_available_nodes: int,
) -> TrimmedMean:
    """The factory ``--strategy`` names: takes the run's sampling settings (not its weighting)."""
    return TrimmedMean(
        trim=1, fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
        min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
        min_available_nodes=min_available_nodes, weighted_by_key="num-examples",
    )


def not_a_strategy() -> object:
    return object()
