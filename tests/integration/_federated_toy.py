"""A tiny classification task for the federated tests (factories named by MODULE:FUNCTION)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

ITEMS = 32


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


class _Broken(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the model is broken on purpose")


def make_broken_model() -> nn.Module:
    """``make_model``'s layers (the same weights load) whose forward raises."""
    return _Broken(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(ITEMS, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.3).long()
    data = TensorDataset(x, y)
    data.targets = y  # type: ignore[attr-defined]
    return data


def centralized_sgd_step(lr: float) -> dict[str, torch.Tensor]:
    """The reference of the FedAvg parity tests: the federated run's initial global model
    (``Task.model()``: the default seed) after one plain SGD step on the whole toy set, the union
    of equal IID clients' single batches."""
    from torsh_distributed.federated.config import FederatedConfig, TaskConfig
    from torsh_distributed.federated.task import Task

    task = TaskConfig(model=f"{__file__}:make_model", dataset=f"{__file__}:dataset")
    model = Task(FederatedConfig(partition="iid", clients=2, task=task)).model()
    x, y = dataset().tensors
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return {k: v.detach() for k, v in model.state_dict().items()}
