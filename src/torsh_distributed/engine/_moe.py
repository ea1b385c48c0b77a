"""The engine's Mixture-of-Experts duties, no-ops for a model without MoE layers.

* :meth:`MoEHooks.add_losses`: the layers' auxiliary losses (load balancing, z-loss) join the
  task loss of every training forward (evaluation reports the task loss alone). They are
  computed over the global batch of the ``dp * ep`` data-parallel ranks
  (:meth:`~torsh_distributed.parallel.moe.MoE.set_balance_group`), so a parallel run's loss and
  gradients equal one process's on the same global batch.
* :meth:`MoEHooks.reduce_expert_grads`: with ``ep > 1`` the expert gradients are summed over
  the ranks holding the same experts and divided by ``dp * ep`` (not scaled by the EP degree:
  :mod:`torsh_distributed.parallel.expert`); DDP averages the dense ones over ``dp * ep``. The
  experts are DTensors sharded over the ``ep`` mesh (so checkpoints hold them once, with their
  global shape, and reshard to another ep degree); their gradients are reduced, and clipped
  (:meth:`MoEHooks.clip`), through the local shards.
* :meth:`MoEHooks.after_step`: the aux-loss-free selection bias moves with the load summed
  over every data-parallel rank (so all replicas keep the same bias), and the load statistics of
  the step (tokens per expert, dropped slots, coefficient of variation) are accumulated and
  logged to the step monitor (``moe_load_cv``, ``moe_dropped``).
* :meth:`MoEHooks.summary`: the ``moe`` block of the run summary, over all ranks and steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.comm.dims import ParallelDims
from torsh_distributed.monitor.step import StepMonitor
from torsh_distributed.parallel.expert import (
    clip_grad_norm_with_experts_,
    expert_parameters,
    reduce_expert_grads,
    update_moe_biases,
)
from torsh_distributed.parallel.moe import moe_layers, moe_losses

__all__ = ["MoEHooks"]


class MoEHooks:
    """See the module docstring.

    Args:
        model: The module holding this rank's MoE layers (after expert parallelism).
        dims: The run's built dims (``dp``/``ep`` degrees, the data-parallel groups).
    """

    def __init__(self, model: nn.Module, dims: ParallelDims) -> None:
        self.model, self.dims = model, dims
        self.layers = list(moe_layers(model))
        self.on = bool(self.layers)
        self.experts = expert_parameters(model) if self.on and dims.ep > 1 else []
        self.balancing = any(layer.config.bias_update_rate > 0 for layer in self.layers)
        num = max((layer.config.num_experts for layer in self.layers), default=0)
        self._routed = torch.zeros(len(self.layers), num, dtype=torch.float64)
        self._kept = torch.zeros(len(self.layers), num, dtype=torch.float64)
        if dims.data_degree > 1:  # balancing losses over the global batch, as one process
            for layer in self.layers:
                layer.set_balance_group(dims.data_group(), dims.data_degree)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Custom metrics the step monitor must declare."""
        return ("moe_load_cv", "moe_dropped") if self.on else ()

    def add_losses(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus every MoE layer's auxiliary loss of the forward just run."""
        if not self.on or not torch.is_grad_enabled():
            return loss
        return loss + moe_losses(self.model).to(loss.device)

    def wrap(
        self, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> Callable[[Any, Any], torch.Tensor]:
        """``loss_fn`` whose result includes the auxiliary losses (gradient accumulation)."""
        if not self.on:
            return loss_fn
        return lambda output, target: self.add_losses(loss_fn(output, target))

    def reduce_expert_grads(self) -> None:
        """ep > 1: expert gradients summed over their dp group and divided by ``dp * ep``."""
        if self.experts:
            dims = self.dims
            reduce_expert_grads(self.experts, group=dims.group("dp"), dp=dims.dp, ep=dims.ep)

    def clip(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor | None:
        """ep > 1: clip by the norm over every rank's experts (a local norm would differ per
        rank); ``None`` otherwise (the engine's usual clipping applies)."""
        if not self.experts:
            return None
        return clip_grad_norm_with_experts_(
            params, max_norm, experts=self.experts, group=self.dims.group("ep")
        )

    def after_step(self, monitor: StepMonitor) -> None:
        """Bias balancing, then this step's load into the run totals and the monitor."""
        if not self.on:
            return
        group = self.dims.data_group() if self.dims.data_degree > 1 else None
        if self.balancing:
            update_moe_biases(self.model, group=group)
        cvs, dropped = [], 0
        for i, layer in enumerate(self.layers):
            stats = layer.stats
            if stats is None:
                continue
            self._routed[i, : len(stats.routed_per_expert)] += torch.tensor(
                stats.routed_per_expert, dtype=torch.float64
            )
            self._kept[i, : len(stats.tokens_per_expert)] += torch.tensor(
                stats.tokens_per_expert, dtype=torch.float64
            )
            cvs.append(stats.load_cv)
            dropped += stats.dropped
        if cvs:
            monitor.log("moe_load_cv", sum(cvs) / len(cvs))  # this rank's routing, mean of layers
            monitor.log("moe_dropped", float(dropped))

    def summary(self) -> dict[str, Any]:
        """Tokens per expert (summed over ranks and steps), dropped share and load CV per layer;
        a collective over the data-parallel ranks."""
        if not self.on:
            return {}
        routed, kept = self._routed.clone(), self._kept.clone()
        if self.dims.data_degree > 1 and dist.is_initialized():
            both = torch.stack([routed, kept])
            dist.all_reduce(both, group=self.dims.data_group())
            routed, kept = both[0], both[1]
        layers = []
        for i, layer in enumerate(self.layers):
            r = routed[i, : layer.config.num_experts]
            k = kept[i, : layer.config.num_experts]
            mean = float(r.mean())
            layers.append(
                {
                    "tokens_per_expert": [int(v) for v in k.tolist()],
                    "dropped_share": float((r.sum() - k.sum()) / r.sum()) if r.sum() > 0 else 0.0,
                    "load_cv": float(r.std(unbiased=False)) / mean if mean > 0 else 0.0,
                }
            )
        return {
            "layers": len(layers),
            "ep": self.dims.ep,
            "load_cv": sum(x["load_cv"] for x in layers) / len(layers),
            "dropped_share": sum(x["dropped_share"] for x in layers) / len(layers),
            "per_layer": layers,
        }
