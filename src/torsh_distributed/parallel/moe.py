"""Mixture-of-Experts layer: a top-k token-choice router, grouped experts, shared experts and
load balancing. No communication here: expert parallelism (:mod:`.expert`) replaces one step.

Forward of :class:`MoE` on ``x: [..., d_model]`` (``T`` tokens after flattening):

1. **Route** (in at least fp32: bf16 logits make near-ties flip between runs). ``logits = x W_r^T``;
   ``softmax`` scores are the probabilities, ``sigmoid`` scores are independent gates (DeepSeek-V3)
   whose normalised form ``s / sum(s)`` serves as "probability" in the balancing loss. The top-k
   experts of ``score + expert_bias`` are selected; the combine weights are the *unbiased* scores
   of the selected experts (not renormalised, torchtitan's default ``route_norm=False``).
2. **Group** the ``T * top_k`` token-slots by expert (ascending expert id). With
   ``capacity_factor > 0`` each expert keeps at most ``ceil(capacity_factor * T * top_k / E)``
   slots: those with the highest combine weight, ties broken by token order (deterministic, so a
   rerun or a parallel run drops exactly the same tokens). A dropped slot contributes zero (the
   token still flows through the residual connection around the layer).
3. **Run the experts** through one function, :meth:`MoE.run_experts`, which receives the grouped
   tokens and ``tokens_per_expert``, ordered by *slot* (the row of the stacked expert weights
   holding the expert: ``expert_slot``, the identity until :mod:`.rebalance` moves experts).
   Locally it calls :class:`GroupedExperts`; under expert parallelism a dispatcher
   (:func:`~.expert.apply_ep`) sends each block of slots' tokens to the rank holding them and
   brings the results back in the same order.
4. **Combine**: each slot's output times its weight, summed per token; plus the shared experts
   (a dense FFN every token goes through) when ``num_shared_experts > 0``.

Losses, read after forward: ``moe.aux_loss`` (Switch load balancing,
``aux_loss_coef * E * sum_e f_e P_e`` with ``f_e`` the fraction of token-slots routed to ``e``
*before* dropping and ``P_e`` the mean router probability), ``moe.z_loss`` (ST-MoE,
``z_loss_coef * mean(logsumexp(logits)^2)``) and ``moe.loss`` (their sum). Add
:func:`moe_losses` ``(model)`` to the task loss. Both are computed over the tokens of *this*
forward call (under data/expert parallelism: this rank's micro-batch, as Megatron-Core does).

Aux-loss-free balancing (DeepSeek-V3, ``bias_update_rate > 0``): a per-expert ``expert_bias``
buffer shifts selection only; training forwards accumulate the routed load and, after each
optimizer step, :func:`~.expert.update_moe_biases` moves the bias by
``rate * sign(mean_load - load)`` (all-reducing the load over data-parallel ranks so every
replica keeps the same bias). The bias never enters the combine weights, so it has no gradient
and does not change the gradient for a given selection.

Experts use GELU, ``gelu(x W1_e) W2_e`` with stacked ``w1: [E, d_model, d_hidden]`` and
``w2: [E, d_hidden, d_model]``: two matrices per expert keep the shapes simple to shard. SwiGLU
(a third matrix) is better per FLOP in large LMs; add it here if a model needs it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "SCORES",
    "Dispatcher",
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "MoEStats",
    "moe_layers",
    "moe_losses",
]

SCORES = ("softmax", "sigmoid")
"""Router score functions."""


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """One MoE layer: experts, routing, capacity and balancing. Torch-free; validated here."""

    num_experts: int
    """Routed experts ``E``. More experts add parameters at constant compute per token, but each
    sees fewer tokens (less efficient matmuls, noisier balance)."""
    d_model: int
    """Width of the tokens entering and leaving the layer."""
    d_hidden: int
    """Hidden width of each expert's FFN (fine-grained experts use a small one and more experts)."""
    top_k: int = 2
    """Experts per token (1 <= top_k <= num_experts): compute per token grows linearly with it."""
    score: str = "softmax"
    """``softmax`` (probabilities competing across experts; Switch, Mixtral) or ``sigmoid``
    (independent gates; DeepSeek-V3, pairs well with the bias balancing)."""
    num_shared_experts: int = 0
    """Always-on experts, fused into one dense FFN of width ``num_shared_experts * d_hidden``
    (DeepSeek-MoE): common knowledge without routing, at dense cost for every token."""
    capacity_factor: float = 0.0
    """0 = dropless (every routed slot is computed; memory and time follow the imbalance).
    > 0: each expert keeps at most ``ceil(capacity_factor * tokens * top_k / num_experts)``
    slots of each forward call (this rank's tokens), the highest-weighted ones; bounded cost,
    but dropped tokens skip the layer."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss (0 = off). Too high hurts quality (it fights the
    router); the bias balancing below achieves balance without that gradient."""
    z_loss_coef: float = 0.0
    """Weight of the ST-MoE router z-loss (keeps logits small, which stabilises bf16 training);
    1e-3 is the usual value."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3 aux-loss-free balancing: step of the per-expert selection bias after each
    optimizer step (0 = off; 1e-3 is the paper's value). Fast to react, no gradient interference,
    but needs :func:`~.expert.update_moe_biases` called in the training loop."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "d_model", "d_hidden", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})"
            )
        shared = self.num_shared_experts
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {shared!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def capacity(self, num_tokens: int) -> int:
        """Slots each expert keeps for a call with ``num_tokens`` tokens; 0 = unlimited.

        The 1e-9 guards against ``ceil`` rounding an exact product like ``1.1 * 40 / 4`` up.
        """
        if self.capacity_factor == 0 or num_tokens == 0:
            return 0
        exact = self.capacity_factor * num_tokens * self.top_k / self.num_experts
        return max(1, math.ceil(exact - 1e-9))


@dataclass(slots=True)
class MoEStats:
    """What the last forward of one layer routed, for logging: this rank's tokens over all
    (global) experts, also under expert parallelism (sum over ranks for the global load)."""

    tokens_per_expert: list[int]
    """Slots each expert computed (after dropping)."""
    routed_per_expert: list[int]
    """Slots the router sent to each expert (before dropping)."""
    dropped: int
    """Slots dropped for capacity (``sum(routed) - sum(tokens)``)."""
    load_cv: float
    """Coefficient of variation (std / mean) of the routed load: 0 = perfectly balanced."""


class Dispatcher(Protocol):
    """Replaces the local expert call: ``tokens`` grouped by (global) expert slot, their counts
    ``[num_experts]`` per slot, and the layer's (possibly sharded) experts; returns outputs in
    the same row order as ``tokens``."""

    def __call__(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor: ...


def _fan_in_uniform_(t: torch.Tensor, fan_in: int) -> None:
    bound = 1.0 / math.sqrt(fan_in)
    t.uniform_(-bound, bound)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (differentiable: gradients flow back into the DTensor's
    ``grad``), or a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """A block of experts stored stacked: ``w1: [L, d_model, d_hidden]``, ``w2: [L, d_hidden,
    d_model]``, holding global experts ``[expert_offset, expert_offset + L)`` of ``num_experts``.

    Unsharded, ``L == num_experts``. Expert parallelism keeps a rank's block: :meth:`shard_` as
    DTensors sharded ``Shard(0)`` over the ``ep`` mesh (global shape ``[num_experts, ...]``, so a
    DCP checkpoint holds one tensor per name and reshards to another ep degree), :meth:`keep_` as
    plain tensors. The forward runs the local shard; it loops over the local experts (one pair
    of matmuls each); a grouped GEMM (``torch._grouped_mm`` on recent GPUs) would remove the loop
    where it is available.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_hidden: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.d_model = d_model
        self.d_hidden = d_hidden
        self.expert_offset = 0
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_hidden, d_model, **kw))

    @property
    def num_local_experts(self) -> int:
        with torch.no_grad():
            return _local(self.w1).shape[0]

    @property
    def sharded(self) -> bool:
        """Whether this holds a block of the experts (:meth:`keep_` or :meth:`shard_` ran)."""
        return isinstance(self.w1, DTensor) or self.num_local_experts != self.num_experts

    def keep_(self, start: int, stop: int) -> GroupedExperts:
        """Keep only global experts ``[start, stop)`` (new plain parameters; no communication).

        Call before building the optimizer: the old parameters are replaced, not resized.
        """
        if self.sharded:
            raise ValueError("experts are already sharded; keep_ applies to a full block once")
        if not 0 <= start < stop <= self.num_experts:
            raise ValueError(
                f"expert range must satisfy 0 <= start < stop <= {self.num_experts}, "
                f"got [{start}, {stop})"
            )
        for name in ("w1", "w2"):
            old = getattr(self, name)
            new = nn.Parameter(old.detach()[start:stop].clone(), requires_grad=old.requires_grad)
            setattr(self, name, new)
        self.expert_offset = start
        return self

    def shard_(self, mesh: DeviceMesh) -> GroupedExperts:
        """Keep the block of this rank of the 1-D ``mesh`` (rank ``r`` of ``n``: experts
        ``[r E/n, (r+1) E/n)``) as parameters that are DTensors sharded ``Shard(0)`` over it.

        No communication (the global shape is known). Works on the ``meta`` device (then
        ``to_empty`` and :meth:`reset_parameters`). Call before building the optimizer.

        Raises:
            ValueError: ``mesh`` is not 1-D, ``num_experts`` is not divisible by its size, or
                the experts are already sharded.
        """
        if mesh.ndim != 1:
            raise ValueError(f"shard_ needs a 1-D mesh, got {mesh.ndim}-D")
        size, rank = mesh.size(), mesh.get_local_rank()
        if self.num_experts % size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by the mesh size ({size})"
            )
        num_local = self.num_experts // size
        self.keep_(rank * num_local, (rank + 1) * num_local)
        for name in ("w1", "w2"):
            local = getattr(self, name)
            shape = (self.num_experts, *local.shape[1:])
            stride = torch.empty(shape, device="meta").stride()
            sharded = DTensor.from_local(
                local.detach(), mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
            )
            setattr(self, name, nn.Parameter(sharded, requires_grad=local.requires_grad))
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every *global* expert in order (w1 then w2 of expert 0, then expert 1, ...) from
        the global RNG, keeping the local ones: a sharded block gets exactly the values of its
        slice of the unsharded layer under the same seed, at the cost of drawing (into one
        scratch expert) the experts other ranks hold."""
        w1, w2 = _local(self.w1), _local(self.w2)  # no_grad: the shards themselves, filled in place
        local = range(self.expert_offset, self.expert_offset + w1.shape[0])
        scratch1 = torch.empty_like(w1[0])
        scratch2 = torch.empty_like(w2[0])
        for e in range(self.num_experts):
            mine = e in local
            _fan_in_uniform_(w1[e - self.expert_offset] if mine else scratch1, self.d_model)
            _fan_in_uniform_(w2[e - self.expert_offset] if mine else scratch2, self.d_hidden)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``tokens: [N, d_model]`` grouped by local expert, ``tokens_per_expert: [L]`` summing to
        ``N``; returns ``[N, d_model]`` in the same order. Experts with no tokens still take part
        (zero gradients), so every parameter gets a gradient on every rank."""
        counts = [int(c) for c in tokens_per_expert.tolist()]
        if len(counts) != self.num_local_experts or sum(counts) != tokens.shape[0]:
            raise ValueError(
                f"tokens_per_expert must have {self.num_local_experts} entries summing to "
                f"{tokens.shape[0]}, got {counts}"
            )
        w1, w2 = _local(self.w1), _local(self.w2)
        outs = [
            F.gelu(chunk @ w1[e]) @ w2[e] for e, chunk in enumerate(torch.split(tokens, counts))
        ]
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (
            f"experts [{self.expert_offset}, {self.expert_offset + self.num_local_experts}) "
            f"of {self.num_experts}, d_model={self.d_model}, d_hidden={self.d_hidden}"
        )


class _DenseFFN(nn.Module):
    """The shared experts: ``gelu(x W1^T) W2^T`` applied to every token."""

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        *,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_hidden, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(d_hidden, d_model, bias=False, device=device, dtype=dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        _fan_in_uniform_(self.w1.weight, self.w1.in_features)
        _fan_in_uniform_(self.w2.weight, self.w2.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    """A Mixture-of-Experts FFN: ``forward(x: [..., d_model]) -> [..., d_model]`` (see the
    module docstring for the algorithm, the losses and the balancing).

    Args:
        config: The layer's :class:`MoEConfig`.
        device: Where to allocate (``"meta"`` to build without memory, then ``to_empty`` and
            :meth:`reset_parameters`).
        dtype: Parameter dtype. Routing runs in at least fp32 whatever this is.

    Attributes set by forward: ``aux_loss``, ``z_loss`` (0-d tensors with grad), ``loss`` (their
    sum) and :attr:`stats`.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(
            config.d_model, config.num_experts, bias=False, device=device, dtype=dtype
        )
        self.experts = GroupedExperts(
            config.num_experts, config.d_model, config.d_hidden, device=device, dtype=dtype
        )
        self.shared: _DenseFFN | None = None
        if config.num_shared_experts:
            width = config.num_shared_experts * config.d_hidden
            self.shared = _DenseFFN(config.d_model, width, device=device, dtype=dtype)
        # Selection bias: a buffer (checkpointed, never a parameter), kept in fp32 so that small
        # rate steps are not rounded away in bf16.
        self.register_buffer(
            "expert_bias", torch.zeros(config.num_experts, device=device, dtype=torch.float32)
        )
        # Placement: expert e's weights are row ``expert_slot[e]`` of the stacked experts (under
        # expert parallelism, on ep rank ``expert_slot[e] // (E / ep)``). The identity until the
        # rebalancer (:mod:`.rebalance`) moves experts; checkpointed with the weights it indexes.
        self.register_buffer(
            "expert_slot", torch.arange(config.num_experts, device=device, dtype=torch.long)
        )
        self.dispatcher: Dispatcher | None = None
        self._balance: tuple[Any, int] | None = None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        # Not buffers: DDP's buffer broadcast would overwrite each rank's own count with rank 0's.
        self._load: torch.Tensor | None = None
        self._totals: torch.Tensor | None = None  # [2, E] routed / kept slots, training forwards
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise router, experts, shared experts (in that order) from the global RNG, and
        zero the selection bias: deterministic under a seed, so meta-device init works."""
        _fan_in_uniform_(self.router.weight, self.config.d_model)
        self.experts.reset_parameters()
        if self.shared is not None:
            self.shared.reset_parameters()
        self.expert_bias.zero_()
        self.expert_slot.copy_(torch.arange(self.config.num_experts))
        self._load = None
        self._totals = None

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if x.shape[-1] != cfg.d_model:
            raise ValueError(f"expected input [..., {cfg.d_model}], got {list(x.shape)}")
        flat = x.reshape(-1, cfg.d_model)
        num_tokens = flat.shape[0]
        logits, scores, probs = self._scores(flat)
        with torch.no_grad():
            selected = (scores + self.expert_bias.to(scores.dtype)).topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, selected)
        slot_expert = selected.reshape(-1)
        routed = torch.bincount(slot_expert, minlength=cfg.num_experts)
        self._set_losses(logits, probs, routed, num_tokens)

        order, tokens_per_expert = self._group(slot_expert, weights.detach().reshape(-1), routed)
        token_of_slot = torch.div(order, cfg.top_k, rounding_mode="floor")
        out = self._run_placed(flat[token_of_slot], tokens_per_expert)
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        y = out.new_zeros(num_tokens, cfg.d_model).index_add(0, token_of_slot, out)
        if self.shared is not None:
            y = y + self.shared(flat)

        with torch.no_grad():
            self._last = (tokens_per_expert.detach(), routed.detach())
            if self.training:
                both = torch.stack([routed, tokens_per_expert]).to(torch.float64)
                self._totals = both if self._totals is None else self._totals + both
            if self.training and cfg.bias_update_rate > 0:
                if self._load is None or self._load.device != routed.device:
                    self._load = torch.zeros(cfg.num_experts, device=routed.device)
                self._load += routed
        return y.reshape(x.shape)

    def _run_placed(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert id -> grouped by slot (:attr:`expert_slot`) -> experts ->
        back to expert order. Within an expert the rows keep their order (stable sort), so each
        expert's output and gradient, and the combine, are bit-identical whatever the placement."""
        slot = self.expert_slot
        if slot.device != tokens_per_expert.device:
            slot = slot.to(tokens_per_expert.device)
        expert_of_row = torch.repeat_interleave(
            torch.arange(len(slot), device=slot.device), tokens_per_expert
        )
        perm = torch.argsort(slot[expert_of_row], stable=True)
        per_slot = torch.empty_like(tokens_per_expert)
        per_slot[slot] = tokens_per_expert
        out = self.run_experts(tokens[perm], per_slot)
        return out[torch.argsort(perm)]

    def run_experts(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The one place experts run: ``tokens`` grouped by expert *slot* (row of the stacked
        experts; :attr:`expert_slot` maps expert ids to slots, the identity unless experts were
        rebalanced) with counts ``tokens_per_expert: [num_experts]`` per slot; outputs in the
        same order. Expert parallelism installs a :class:`Dispatcher` here."""
        if self.dispatcher is not None:
            return self.dispatcher(tokens, tokens_per_expert, self.experts)
        return self.experts(tokens, tokens_per_expert)

    def _scores(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits, scores, probs)`` in at least fp32, outside autocast."""
        dtype = torch.promote_types(flat.dtype, torch.float32)
        with torch.autocast(device_type=flat.device.type, enabled=False):
            logits = F.linear(flat.to(dtype), self.router.weight.to(dtype))
        if self.config.score == "softmax":
            scores = probs = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores, probs

    def set_balance_group(self, group: Any, size: int) -> None:
        """Compute the balancing losses over the global batch of ``size`` data-parallel ranks.

        Per-rank losses (the default) make ``f_e`` and ``P_e`` statistics of each rank's tokens,
        so ``mean_r sum_e f_e^r P_e^r`` differs from one process's loss on the whole batch. With a
        group, each training forward all-reduces the routed counts and the token count (one
        small collective per layer; ``f`` has no gradient), and this rank's term is its share of
        the global loss scaled by ``size``: averaging gradients over the ranks (DDP) then gives
        exactly the global loss's gradient, and the mean of the ranks' losses its value.
        """
        self._balance = (group, size) if size > 1 else None

    def _set_losses(
        self, logits: torch.Tensor, probs: torch.Tensor, routed: torch.Tensor, num_tokens: int
    ) -> None:
        cfg = self.config
        if self._balance is not None and torch.is_grad_enabled():
            group, size = self._balance
            counts = torch.cat([routed.to(torch.float64), routed.new_tensor([num_tokens]).double()])
            dist.all_reduce(counts, group=group)
            total = float(counts[-1])
            if total == 0:
                self.aux_loss = self.z_loss = logits.sum() * 0.0
                return
            fraction = (counts[:-1] / (total * cfg.top_k)).to(probs.dtype)
            share = size / total  # this rank's sums over the global token count, times size
            self.aux_loss = (
                cfg.aux_loss_coef * cfg.num_experts * (fraction * probs.sum(0)).sum() * share
            )
            lse = torch.logsumexp(logits, dim=-1).square().sum()
            self.z_loss = cfg.z_loss_coef * lse * share
            return
        if num_tokens == 0:
            # Zero, but attached to the router so that backward (and DDP) sees a gradient.
            self.aux_loss = self.z_loss = logits.sum() * 0.0
            return
        fraction = routed.to(probs.dtype) / (num_tokens * cfg.top_k)
        self.aux_loss = cfg.aux_loss_coef * cfg.num_experts * (fraction * probs.mean(0)).sum()
        self.z_loss = cfg.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()

    def _group(
        self, slot_expert: torch.Tensor, slot_weight: torch.Tensor, routed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot indices ordered by expert (kept slots only) and the kept count per expert."""
        capacity = self.config.capacity(slot_expert.numel() // self.config.top_k)
        if not capacity:
            return torch.argsort(slot_expert, stable=True), routed
        # Two stable sorts: by weight (descending; ties keep slot = token order), then by expert.
        by_weight = torch.argsort(-slot_weight, stable=True)
        order = by_weight[torch.argsort(slot_expert[by_weight], stable=True)]
        starts = torch.cumsum(routed, 0) - routed
        rank_in_expert = (
            torch.arange(order.numel(), device=order.device) - starts[slot_expert[order]]
        )
        return order[rank_in_expert < capacity], routed.clamp(max=capacity)

    # -- results ----------------------------------------------------------------------------
    @property
    def loss(self) -> torch.Tensor | None:
        """``aux_loss + z_loss`` of the last forward (``None`` before the first)."""
        if self.aux_loss is None or self.z_loss is None:
            return None
        return self.aux_loss + self.z_loss

    @property
    def stats(self) -> MoEStats | None:
        """Routing of the last forward (``None`` before the first). Reading it syncs the device."""
        if self._last is None:
            return None
        kept, routed = (t.tolist() for t in self._last)
        load = self._last[1].double()
        mean = load.mean().item()
        cv = load.std(unbiased=False).item() / mean if mean > 0 else 0.0
        return MoEStats(
            tokens_per_expert=[int(c) for c in kept],
            routed_per_expert=[int(c) for c in routed],
            dropped=int(sum(routed) - sum(kept)),
            load_cv=cv,
        )

    @property
    def totals(self) -> torch.Tensor | None:
        """``[2, num_experts]`` float64: slots routed to (row 0) and kept by (row 1) each expert,
        summed over every training forward of this layer on this rank (micro-batches included);
        never reset, so each reader keeps its own snapshot. ``None`` before the first."""
        return self._totals

    @property
    def load(self) -> torch.Tensor | None:
        """Slots routed per expert by training forwards since the last bias update (``None``
        when bias balancing is off or nothing was routed yet)."""
        return self._load

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None) -> None:
        """One DeepSeek-V3 step: ``expert_bias += rate * sign(mean(load) - load)``; then forget
        the accumulated load. ``load`` defaults to this layer's own (pass the load summed over
        data-parallel ranks so all replicas agree; :func:`~.expert.update_moe_biases` does)."""
        load = self._load if load is None else load
        rate = self.config.bias_update_rate
        if rate > 0 and load is not None:
            load = load.to(self.expert_bias.device, torch.float32)
            self.expert_bias += rate * torch.sign(load.mean() - load)
        self._load = None

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"num_experts={c.num_experts}, top_k={c.top_k}, score={c.score}, "
            f"capacity_factor={c.capacity_factor}, shared={c.num_shared_experts}"
        )


def moe_layers(model: nn.Module) -> Iterator[MoE]:
    """Every :class:`MoE` submodule of ``model`` (``model`` itself included), in module order."""
    for module in model.modules():
        if isinstance(module, MoE):
            yield module


def moe_losses(model: nn.Module) -> torch.Tensor:
    """Sum of every MoE layer's ``loss`` from its last forward: add it to the task loss.

    Layers that have not run (another pipeline stage's) are skipped; a model without MoE layers
    gives a 0-d zero.
    """
    losses = [loss for layer in moe_layers(model) if (loss := layer.loss) is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum() if len(losses) > 1 else losses[0]
