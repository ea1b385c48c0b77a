"""Factories for ``torsh-dist federated`` on scikit-learn's handwritten digits (8x8, 10 classes).

    torsh-dist federated --model examples/federated_digits.py:make_model \\
        --dataset examples/federated_digits.py:train_set \\
        --val-dataset examples/federated_digits.py:test_set \\
        --partition dirichlet --alpha 0.1 --clients 10 --rounds 20

The 1,797 images are split once, deterministically: 1,497 for the clients (partitioned by
``--partition``), 300 held out for the server's loss and accuracy after each round. Each item is
``(pixels as 64 floats in [0, 1], label)``; ``train_set().targets`` lets the partitioners read the
labels without touching every item.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

_HELD_OUT = 300


def make_model() -> nn.Module:
    """A small MLP: 64 pixels -> 64 hidden -> 10 classes."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def make_wide_model() -> nn.Module:
    """A 1.2M-parameter MLP (4.8 MB of fp32 weights) for bandwidth experiments: 64 -> 1024 -> 1024
    -> 10. The digits need far less; its size is what makes compressed updates matter on a slow link."""
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return x[order], y[order]


class _Labelled(TensorDataset):
    """A ``TensorDataset`` of (pixels, label) that exposes ``targets`` for the partitioners."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(x, y)
        self.targets = y


def train_set() -> TensorDataset:
    """The clients' 1,497 images."""
    x, y = _digits()
    return _Labelled(x[_HELD_OUT:], y[_HELD_OUT:])


def test_set() -> TensorDataset:
    """The server's 300 held-out images."""
    x, y = _digits()
    return _Labelled(x[:_HELD_OUT], y[:_HELD_OUT])
