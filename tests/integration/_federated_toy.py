"""A tiny classification task for the federated tests (factories named by MODULE:FUNCTION)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

ITEMS = 32


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(ITEMS, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.3).long()
    data = TensorDataset(x, y)
    data.targets = y  # type: ignore[attr-defined]
    return data
