"""The engine's default optimizer and learning-rate schedule (``OptimConfig``).

Users may pass their own optimizer factory and scheduler to the engine instead; these are what
``torsh-dist train`` uses: AdamW (betas 0.9, 0.95), SGD, 1-bit Adam or 0/1 Adam, weight decay on
matrices only, linear warm-up then cosine decay to ``min_lr_ratio``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.compression.onebit import OneBitAdam, ZeroOneAdam
from torsh_distributed.engine.config import OptimConfig
from torsh_distributed.plan.lr_scaling import LRScaling, lr_scaling

__all__ = ["build_optimizer", "lr_at", "scale_for_batch"]


def scale_for_batch(optim: OptimConfig, global_batch: int) -> tuple[OptimConfig, LRScaling | None]:
    """``optim`` with ``lr`` and ``warmup_steps`` scaled from ``optim.lr_ref_batch`` to
    ``global_batch`` (``lr_ref_batch`` then 0, so scaling twice changes nothing), and the rule's
    record; ``(optim, None)`` when ``lr_ref_batch`` is 0."""
    if not optim.lr_ref_batch:
        return optim, None
    rule = lr_scaling(
        global_batch=global_batch,
        reference_batch=optim.lr_ref_batch,
        optimizer="sgd" if optim.optimizer == "sgd" else "adam",
        reference_lr=optim.lr,
        reference_warmup_steps=optim.warmup_steps,
        rule=optim.lr_scaling,
    )
    scaled = dataclasses.replace(
        optim,
        lr=rule.lr if rule.lr is not None else optim.lr,
        warmup_steps=rule.warmup_steps if rule.warmup_steps is not None else optim.warmup_steps,
        lr_ref_batch=0,
    )
    return scaled, rule


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


def build_optimizer(
    model: nn.Module, optim: OptimConfig, *, group: dist.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """AdamW, SGD, 1-bit Adam or 0/1 Adam over ``model``'s parameters; matrices decay, vectors
    (biases, norms) do not. ``group``: the data-parallel group the last two communicate over
    (``None``: the default group)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (optim.beta1, optim.beta2)
    if optim.optimizer == "onebit_adam":
        return OneBitAdam(
            groups,
            lr=optim.lr,
            betas=betas,
            eps=optim.eps,
            freeze_step=optim.freeze_step,
            group=group,
        )
    if optim.optimizer == "zerooneadam":
        return ZeroOneAdam(
            groups,
            lr=optim.lr,
            betas=betas,
            eps=optim.eps,
            var_freeze_step=optim.freeze_step,
            var_update_scaler=optim.var_update_scaler,
            local_step_scaler=optim.local_step_scaler,
            local_step_clipper=optim.local_step_clipper,
            group=group,
        )
    if optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, foreach=True)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=betas, eps=optim.eps, foreach=True)
