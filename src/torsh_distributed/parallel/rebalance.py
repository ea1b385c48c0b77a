"""Expert load rebalancing: move experts between ``ep`` ranks when their load stays skewed.

Under expert parallelism the ``ep`` rank holding the busiest experts computes for all of them
while the others wait in the all-to-all. The router's balancing losses act on the *experts'*
load; this acts on the *ranks'*: every ``every`` steps the routed load of the window (slots per
expert, summed over every data-parallel rank) gives each rank's load under the current placement,
and when their coefficient of variation (std / mean over the ``ep`` ranks) exceeds ``threshold``
a new placement is planned (greedy longest-processing-time: experts by decreasing load, each to
the least-loaded rank with a free slot; experts that stay on their rank keep their slot). If it
lowers the CV, the experts move.

A move is a permutation of the rows of the stacked expert weights (:class:`~.moe.GroupedExperts`),
applied to the parameters, their gradients (if any) and every optimizer state tensor of the same
shape (Adam's moments, SGD's momentum), then recorded in the layer's ``expert_slot`` buffer, which
the forward uses to send each expert's tokens to its new row. Routing is by expert id and each
expert keeps its tokens in the same order, so the loss, the gradients and the optimizer updates
are bit-identical to a run without migration; only which rank computes what changes. The one
exception is the global gradient norm used for clipping: its sum of squares over the ep ranks is
summed in another grouping after a move, which can change it in the last bits.

Sharded experts (DTensors over the ``ep`` mesh) move by one all-gather of the layer's weights
(and of each moment) over the ``ep`` group, each rank keeping its new rows: exact and simple,
at the cost of holding one layer's full experts for a moment (an all-to-all of only the moved
rows would send less). Every rank decides from the same all-reduced loads with deterministic
ties, so all take the same decision and run the same collectives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torsh_distributed.comm import collectives
from torsh_distributed.parallel.moe import MoE, moe_layers

__all__ = [
    "ExpertRebalancer",
    "RebalanceConfig",
    "move_experts_",
    "plan_placement",
    "rank_load_cv",
]


@dataclass(kw_only=True, slots=True)
class RebalanceConfig:
    """When the rebalancer looks and when it acts."""

    every: int
    """Steps per window: the load is summed over this many steps, then a move is considered.
    Short windows react to noise (and each move costs an all-gather of the experts); 50-200
    steps suit real runs."""
    threshold: float = 0.1
    """Move only when the ranks' load CV over the window exceeds this (0 = whenever a better
    placement exists)."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"RebalanceConfig.every must be an int >= 1, got {self.every!r}")
        if not self.threshold >= 0:
            raise ValueError(f"RebalanceConfig.threshold must be >= 0, got {self.threshold!r}")


def _check(load: torch.Tensor, ep: int) -> int:
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be an int >= 1, got {ep!r}")
    if load.dim() != 1 or load.numel() % ep:
        raise ValueError(
            f"load must be 1-D with a length divisible by ep ({ep}), got shape {list(load.shape)}"
        )
    return load.numel() // ep


def rank_load_cv(load: torch.Tensor, slot: torch.Tensor, ep: int) -> float:
    """CV (std / mean) over the ``ep`` ranks of the load each holds when expert ``e`` sits in
    slot ``slot[e]`` (rank ``slot[e] // (E / ep)``); 0 when nothing was routed."""
    local = _check(load, ep)
    per_rank = torch.zeros(ep, dtype=torch.float64)
    per_rank.index_add_(0, slot.cpu() // local, load.double().cpu())
    mean = float(per_rank.mean())
    return float(per_rank.std(unbiased=False)) / mean if mean > 0 else 0.0


def plan_placement(
    load: torch.Tensor, ep: int, current: torch.Tensor | None = None
) -> torch.Tensor:
    """A placement (slot per expert) balancing ``load`` over ``ep`` ranks of ``E / ep`` slots.

    Greedy LPT: experts by decreasing load (ties: lower id first), each to the least-loaded rank
    with a free slot (ties: its current rank, then the lowest). Experts left on their ``current`` rank keep their slot;
    the others fill the free slots in ascending order. Deterministic.
    """
    local = _check(load, ep)
    num = load.numel()
    current = torch.arange(num) if current is None else current.cpu().long()
    values = load.double().cpu().tolist()
    order = sorted(range(num), key=lambda e: (-values[e], e))
    totals = [0.0] * ep
    members: list[list[int]] = [[] for _ in range(ep)]
    for e in order:
        home = int(current[e]) // local
        rank = min(
            (r for r in range(ep) if len(members[r]) < local),
            key=lambda r: (totals[r], r != home, r),  # ties: stay home, then the lowest rank
        )
        members[rank].append(e)
        totals[rank] += values[e]
    slot = torch.empty(num, dtype=torch.long)
    for rank, experts in enumerate(members):
        mine = range(rank * local, (rank + 1) * local)
        stay = [e for e in experts if int(current[e]) in mine]
        taken = {int(current[e]) for e in stay}
        free = iter(s for s in mine if s not in taken)
        for e in sorted(experts):
            slot[e] = int(current[e]) if e in stay else next(free)
    return slot


@torch.no_grad()
def _permute_rows_(t: torch.Tensor, source: torch.Tensor) -> None:
    """Row ``i`` of ``t`` (global numbering) becomes old row ``source[i]``; in place."""
    if isinstance(t, DTensor):
        local = t.to_local()
        rows = local.shape[0]
        start = t.device_mesh.get_local_rank() * rows
        full = t.full_tensor()  # all-gather over the ep mesh
        local.copy_(full[source[start : start + rows].to(full.device)])
    else:
        t.copy_(t[source.to(t.device)])


@torch.no_grad()
def move_experts_(
    layer: MoE, slot: torch.Tensor, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Place expert ``e`` of ``layer`` in slot ``slot[e]``: weights, gradients and the optimizer
    state of the same shape move with it. A collective over the ep group when the experts are
    sharded (every rank must call it with the same ``slot``).

    Returns:
        How many experts changed slot.

    Raises:
        ValueError: ``slot`` is not a permutation of ``range(num_experts)``.
    """
    num = layer.config.num_experts
    slot = slot.detach().cpu().long()
    if slot.shape != (num,) or not torch.equal(slot.sort().values, torch.arange(num)):
        raise ValueError(f"slot must be a permutation of range({num}), got {slot.tolist()}")
    old = layer.expert_slot.detach().cpu()
    moved = int((slot != old).sum())
    if not moved:
        return 0
    source = torch.empty_like(slot)
    source[slot] = old  # the new row slot[e] takes expert e from its old row
    state = optimizer.state if optimizer is not None else {}
    for param in (layer.experts.w1, layer.experts.w2):
        tensors = [param, *([param.grad] if param.grad is not None else [])]
        for value in state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                tensors.append(value)
        for t in tensors:
            _permute_rows_(t, source)
    layer.expert_slot.copy_(slot.to(layer.expert_slot.device))
    return moved


class ExpertRebalancer:
    """Watches the MoE layers' load and moves experts between ep ranks (module docstring).

    Call :meth:`step` after every optimizer step on every rank (it is a collective every
    ``config.every`` steps). A no-op for a model without MoE layers.

    Args:
        model: The model whose :class:`~.moe.MoE` layers to balance (after :func:`~.expert.apply_ep`).
        optimizer: Its optimizer (state moves with the experts).
        config: When to look and act.
        ep: The expert-parallel degree (ranks sharing a layer's slots).
        group: The data-parallel ranks whose loads are summed (every rank holding other tokens:
            ``dp * ep``); ``None`` = the world.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        config: RebalanceConfig,
        ep: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layers = list(moe_layers(model))
        for layer in self.layers:
            _check(layer.expert_slot, ep)
        self.optimizer, self.config, self.ep, self.group = optimizer, config, ep, group
        self._seen = [
            torch.zeros(layer.config.num_experts, dtype=torch.float64) for layer in self.layers
        ]
        self._steps = 0
        self.moves = 0
        """Migrations done (one per layer that moved)."""
        self.moved_experts = 0
        """Experts that changed slot, over all migrations."""
        self.history: list[dict[str, float | int]] = []
        """One entry per window: ``step``, ``cv_before`` and ``cv_after`` (mean over layers of the
        ranks' load CV under the old and the chosen placement), ``moved``."""

    def step(self, step: int | None = None) -> bool:
        """Count a step; at the end of a window, move experts if the load stayed skewed.

        Args:
            step: The global step just finished (1-based; a resumed run keeps its windows
                aligned); ``None`` counts the calls.

        Returns:
            Whether any expert moved.
        """
        self._steps = self._steps + 1 if step is None else step
        if not self.layers or self._steps % self.config.every:
            return False
        window = []
        for i, layer in enumerate(self.layers):
            totals = layer.totals
            routed = (
                totals[0].detach().cpu()
                if totals is not None
                else torch.zeros(layer.config.num_experts, dtype=torch.float64)
            )
            window.append(routed - self._seen[i])
            self._seen[i] = routed.clone()
        return self._decide(window)

    def _decide(self, window: Iterable[torch.Tensor]) -> bool:
        loads = list(window)
        flat = torch.cat(loads)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            collectives.all_reduce(flat, group=self.group)
        loads = list(torch.split(flat, [len(x) for x in loads]))
        before, after, moved = [], [], 0
        for layer, load in zip(self.layers, loads, strict=True):
            current = layer.expert_slot.detach().cpu()
            cv = rank_load_cv(load, current, self.ep)
            before.append(cv)
            chosen = current
            if cv > self.config.threshold:
                planned = plan_placement(load, self.ep, current)
                if rank_load_cv(load, planned, self.ep) < cv:
                    chosen = planned
            n = move_experts_(layer, chosen, self.optimizer)
            if n:
                self.moves += 1
                moved += n
            after.append(rank_load_cv(load, chosen, self.ep))
        self.moved_experts += moved
        count = max(len(before), 1)
        self.history.append(
            {
                "step": self._steps,
                "cv_before": sum(before) / count,
                "cv_after": sum(after) / count,
                "moved": moved,
            }
        )
        return moved > 0
