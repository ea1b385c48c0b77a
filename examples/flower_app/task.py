"""The task of examples/flower_app: a small classifier on a synthetic, learnable set."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(96, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)
