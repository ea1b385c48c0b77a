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
  over every data-parallel rank (so all replicas keep the same bias), the load statistics of
  the step (tokens per expert, dropped slots, coefficient of variation; every micro-batch) are
  accumulated and logged to the step monitor (``moe_load_cv``, ``moe_dropped``, with ep > 1
  ``moe_ep_load_cv``: the CV of this rank's slots over the ep ranks computing them), and with
  ``parallel.ep_rebalance_every`` the :class:`~torsh_distributed.parallel.rebalance.ExpertRebalancer`
  moves experts between ep ranks when their load stays skewed.
* :meth:`MoEHooks.summary`: the ``moe`` block of the run summary, over all ranks and steps.
* :meth:`MoEHooks.untracked`: forwards inside leave the layers' load counts as they were (a
  probe such as DDP's bucket priming, not a step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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
from torsh_distributed.parallel.rebalance import ExpertRebalancer, RebalanceConfig

__all__ = ["MoEHooks"]


class MoEHooks:
    """See the module docstring.

    Args:
        model: The module holding this rank's MoE layers (after expert parallelism).
        dims: The run's built dims (``dp``/``ep`` degrees, the data-parallel groups).
        optimizer: The optimizer (its state moves with rebalanced experts).
        rebalance: When to rebalance experts over the ep ranks; ``None`` = never.
    """

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        rebalance: RebalanceConfig | None = None,
    ) -> None:
        self.model, self.dims = model, dims
        self.layers = list(moe_layers(model))
        self.on = bool(self.layers)
        self.experts = expert_parameters(model) if self.on and dims.ep > 1 else []
        self.balancing = any(layer.config.bias_update_rate > 0 for layer in self.layers)
        num = max((layer.config.num_experts for layer in self.layers), default=0)
        self._routed = torch.zeros(len(self.layers), num, dtype=torch.float64)
        self._kept = torch.zeros(len(self.layers), num, dtype=torch.float64)
        # slots routed to each ep rank (under the placement of the time)
        self._ranks = torch.zeros(len(self.layers), dims.ep, dtype=torch.float64)
        self._seen = [
            torch.zeros(2, layer.config.num_experts, dtype=torch.float64) for layer in self.layers
        ]
        data = dims.data_group() if dims.data_degree > 1 else None
        self.rebalancer = (
            ExpertRebalancer(model, optimizer, config=rebalance, ep=dims.ep, group=data)
            if self.on and rebalance is not None and dims.ep > 1
            else None
        )
        if dims.data_degree > 1:  # balancing losses over the global batch, as one process
            for layer in self.layers:
                layer.set_balance_group(dims.data_group(), dims.data_degree)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Custom metrics the step monitor must declare."""
        if not self.on:
            return ()
        return (
            ("moe_load_cv", "moe_dropped", "moe_ep_load_cv")
            if self.dims.ep > 1
            else (
                "moe_load_cv",
                "moe_dropped",
            )
        )

    def add_losses(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus every MoE layer's auxiliary loss of the forward just run."""
        if not self.on or not torch.is_grad_enabled():
            return loss
        return loss + moe_losses(self.model).to(loss.device)

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Forwards inside are not steps: every layer's load counts (the bias balancing's load,
        the statistics' totals) are put back as they were after them."""
        # the layers add to their counts in place, so keep copies
        saved = [
            tuple(None if t is None else t.clone() for t in (layer._load, layer._totals))
            for layer in self.layers
        ]
        last = [layer._last for layer in self.layers]
        try:
            yield
        finally:
            for layer, (load, totals), seen in zip(self.layers, saved, last, strict=True):
                layer._load, layer._totals, layer._last = load, totals, seen

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

    def clip(
        self, params: list[nn.Parameter], max_norm: float, *, dense_sharded: bool = False
    ) -> torch.Tensor | None:
        """ep > 1: clip by the norm over every rank's experts (a local norm would differ per
        rank; ``dense_sharded``: FSDP2 shards the dense gradients over the dp x ep ranks);
        ``None`` otherwise (the engine's usual clipping applies)."""
        if not self.experts:
            return None
        return clip_grad_norm_with_experts_(
            params,
            max_norm,
            experts=self.experts,
            group=self.dims.group("ep"),
            dense_group=self.dims.data_group() if dense_sharded else None,
        )

    def after_step(self, monitor: StepMonitor, step: int | None = None) -> None:
        """Bias balancing, this step's load (every micro-batch) into the run totals and the
        monitor, then rebalancing when due (``step``: the global step just finished)."""
        if not self.on:
            return
        group = self.dims.data_group() if self.dims.data_degree > 1 else None
        if self.balancing:
            update_moe_biases(self.model, group=group)
        cvs, rank_cvs, dropped = [], [], 0.0
        for i, layer in enumerate(self.layers):
            totals = layer.totals
            if totals is None:
                continue
            totals = totals.detach().cpu()
            routed, kept = totals - self._seen[i]
            self._seen[i] = totals.clone()
            num = layer.config.num_experts
            self._routed[i, :num] += routed
            self._kept[i, :num] += kept
            local = num // self.dims.ep
            per_rank = torch.zeros(self.dims.ep, dtype=torch.float64)
            per_rank.index_add_(0, layer.expert_slot.detach().cpu() // local, routed)
            self._ranks[i] += per_rank
            cvs.append(_cv(routed))
            rank_cvs.append(_cv(per_rank))
            dropped += float(routed.sum() - kept.sum())
        if cvs:
            monitor.log("moe_load_cv", sum(cvs) / len(cvs))  # this rank's routing, mean of layers
            monitor.log("moe_dropped", dropped)
            if self.dims.ep > 1:  # this rank's tokens over the ep ranks computing them
                monitor.log("moe_ep_load_cv", sum(rank_cvs) / len(rank_cvs))
        if self.rebalancer is not None:
            self.rebalancer.step(step)

    def summary(self) -> dict[str, Any]:
        """Tokens per expert (summed over ranks and steps), dropped share and load CV per layer;
        a collective over the data-parallel ranks."""
        if not self.on:
            return {}
        routed, kept, ranks = self._routed.clone(), self._kept.clone(), self._ranks.clone()
        if self.dims.data_degree > 1 and dist.is_initialized():
            flat = torch.cat([routed.reshape(-1), kept.reshape(-1), ranks.reshape(-1)])
            dist.all_reduce(flat, group=self.dims.data_group())
            parts = torch.split(flat, [routed.numel(), kept.numel(), ranks.numel()])
            routed, kept, ranks = (
                x.view_as(y) for x, y in zip(parts, (routed, kept, ranks), strict=True)
            )
        layers = []
        for i, layer in enumerate(self.layers):
            r = routed[i, : layer.config.num_experts]
            k = kept[i, : layer.config.num_experts]
            layers.append(
                {
                    "tokens_per_expert": [int(v) for v in k.tolist()],
                    "dropped_share": float((r.sum() - k.sum()) / r.sum()) if r.sum() > 0 else 0.0,
                    "load_cv": _cv(r),
                    "tokens_per_ep_rank": [int(v) for v in ranks[i].tolist()],
                    "ep_load_cv": _cv(ranks[i]),
                    "placement": [int(v) for v in layer.expert_slot.tolist()],
                }
            )
        return {
            "layers": len(layers),
            "ep": self.dims.ep,
            "load_cv": sum(x["load_cv"] for x in layers) / len(layers),
            "dropped_share": sum(x["dropped_share"] for x in layers) / len(layers),
            "ep_load_cv": sum(x["ep_load_cv"] for x in layers) / len(layers),
            "rebalance": None
            if self.rebalancer is None
            else {
                "moves": self.rebalancer.moves,
                "moved_experts": self.rebalancer.moved_experts,
                "windows": self.rebalancer.history,
            },
            "per_layer": layers,
        }


def _cv(values: torch.Tensor) -> float:
    mean = float(values.mean())
    return float(values.std(unbiased=False)) / mean if mean > 0 else 0.0
