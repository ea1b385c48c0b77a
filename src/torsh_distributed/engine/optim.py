"""The engine's default optimizer and learning-rate schedule (``OptimConfig``).

Users may pass their own optimizer factory and scheduler to the engine instead; these are what
``torsh-dist train`` uses: AdamW (betas 0.9, 0.95) or SGD, weight decay on matrices only, linear
warm-up then cosine decay to ``min_lr_ratio``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from torsh_distributed.engine.config import OptimConfig

__all__ = ["build_optimizer", "lr_at"]


def lr_at(step: int, *, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate for 0-based ``step``: linear warm-up, then ``optim.schedule`` (cosine or
    linear decay to ``min_lr_ratio * lr`` at ``max_steps``, or constant)."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    span = max(max_steps - optim.warmup_steps, 1)
    progress = min((step - optim.warmup_steps) / span, 1.0)
    floor = optim.lr * optim.min_lr_ratio
    if optim.schedule == "linear":
        return optim.lr - (optim.lr - floor) * progress
    return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW or SGD over ``model``'s parameters; matrices decay, vectors (biases, norms) do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, foreach=True)
    return torch.optim.AdamW(
        groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=True
    )
