"""Expert parallelism (EP): each rank of the ``ep`` group holds a contiguous block of every MoE
layer's experts and tokens travel to them by all-to-all.

:func:`apply_ep` keeps rank ``r``'s experts ``[r * E / ep, (r + 1) * E / ep)`` as DTensors
sharded ``Shard(0)`` over the ``ep`` mesh (global shape ``[E, ...]``: a DCP checkpoint holds
one tensor per name, written once whatever the ep degree, and reshards on load to another ep
degree or to plain full tensors at ep 1) and installs a dispatcher in
:meth:`MoE.run_experts <.moe.MoE.run_experts>`:

1. all-to-all of the per-expert counts (each rank learns how many rows each peer will send to
   each of its experts; this is also what makes ranks with *zero* tokens work: they send and
   receive empty splits but still take part);
2. all-to-all of the grouped tokens with uneven splits (autograd-aware: its backward is the
   reverse all-to-all), regrouped from (source rank, expert) to (expert, source rank) order;
3. the local experts, the reverse permutation, and the all-to-all back, so the layer combines
   the results with its routing weights exactly as the unsharded layer does.

Routing, dropping and the balancing losses stay on the rank that owns the tokens, so a rank's
forward equals the unsharded layer's on that rank's tokens (capacity included: it is computed
from and applied to *this rank's* tokens before dispatch, like Megatron-Core's token drop at the
source). Collectives go through the :mod:`~torsh_distributed.comm.collectives` facade: a peer
that never arrives raises :class:`~torsh_distributed.runtime.errors.DistributedTimeoutError`
after the process group's timeout; nothing here catches it. Every rank of the ``ep`` group must
run every MoE layer's forward and backward the same number of times (a rank that skips a layer,
or whose loss does not depend on it, leaves its peers waiting until that timeout).

Gradient semantics. EP borrows ranks from data parallelism: the ``dp * ep`` ranks all hold
different tokens. With each rank's loss the mean over its own tokens and the global objective
the mean of the ``dp * ep`` per-rank losses:

* dense (non-expert) parameters are replicated on all ``dp * ep`` ranks: average their gradients
  over all of them (DDP over the world, or the engine's flat all-reduce) as usual;
* an expert's gradient after the all-to-all backward already *sums* the contributions of the
  tokens of all ``ep`` ranks (each sent its rows' gradients back to the expert's owner), and the
  ``dp`` ranks of the expert-data-parallel group hold the same experts for other tokens. The
  global gradient is therefore ``sum over the dp group / (dp * ep)``: :func:`reduce_expert_grads`.
  Averaging over ``dp`` alone (what a DDP over the expert-data-parallel group does) leaves expert
  gradients ``ep`` times too large (pytorch/pytorch#160285), which the tests rule out.

Expert parameters must not be wrapped by a DDP over all ranks (it would broadcast rank 0's
experts over the others' at construction and average unrelated experts): exclude
:func:`expert_parameters` from it and call :func:`reduce_expert_grads` after backward. Their
gradients are DTensors like them; the functions here work on the local shards. An optimizer
over both DTensor experts and plain dense parameters needs ``foreach=False`` (torch's foreach
kernels reject such mixed lists); its state of the experts is then DTensors too and checkpoints
with them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torsh_distributed.comm import collectives
from torsh_distributed.parallel.moe import GroupedExperts, MoE, moe_layers

__all__ = [
    "ExpertDispatcher",
    "apply_ep",
    "clip_grad_norm_with_experts_",
    "expert_parameters",
    "reduce_expert_grads",
    "update_moe_biases",
]

_MARK = "_torsh_expert"


def _all_to_all(
    tokens: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    out = tokens.new_empty((sum(out_splits), *tokens.shape[1:]))
    collectives.all_to_all_single(out, tokens.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all along dim 0 whose backward is the reverse all-to-all (our own rather
    than ``torch.distributed.nn.functional``'s, which is deprecated, so that timeouts come out
    as ``DistributedTimeoutError`` and the profiler sees it)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        tokens: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        return _all_to_all(tokens, out_splits, in_splits, group)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits  # type: ignore[attr-defined]
        group = ctx.group  # type: ignore[attr-defined]
        return _all_to_all(grad, in_splits, out_splits, group), None, None, None


class ExpertDispatcher:
    """Sends each expert's tokens to the ``ep`` rank holding it and brings the results back
    (installed by :func:`apply_ep`; see the module docstring for the steps).

    Costs two blocking host syncs per call (the counts decide the split sizes) and four
    all-to-alls per layer and step (two forward, two backward) plus one small one for counts.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, ep: int, num_experts: int) -> None:
        self.group = group
        self.ep = ep
        self.num_experts = num_experts
        self.num_local = num_experts // ep

    def __call__(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        ep, local = self.ep, self.num_local
        counts = tokens_per_expert.to(device=tokens.device, dtype=torch.long)
        received_counts = torch.empty_like(counts)
        collectives.all_to_all_single(received_counts, counts, group=self.group)
        by_source = received_counts.view(ep, local)  # [source rank, local expert]
        send = counts.view(ep, local).sum(1).tolist()
        recv = by_source.sum(1).tolist()
        received = _AllToAll.apply(tokens, recv, send, self.group)
        if local > 1 and ep > 1:
            expert_of_row = torch.arange(ep * local, device=tokens.device).remainder(local)
            expert_of_row = expert_of_row.repeat_interleave(by_source.reshape(-1))
            perm = torch.argsort(expert_of_row, stable=True)
            out = experts(received[perm], by_source.sum(0))
            out = out[torch.argsort(perm)]
        else:
            out = experts(received, by_source.sum(0))
        return _AllToAll.apply(out, send, recv, self.group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself under ``no_grad``), or a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _resolve_mesh(mesh: DeviceMesh | None, group: dist.ProcessGroup | None) -> DeviceMesh:
    """The 1-D ep mesh: ``mesh``, or one wrapping ``group`` (default: the world; no new group)."""
    if mesh is not None and group is not None:
        raise ValueError("give either mesh or group to apply_ep, not both")
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(
                f"apply_ep needs a 1-D mesh (the ep axis, e.g. dims.mesh['ep']), got {mesh.ndim}-D"
            )
        return mesh
    if not dist.is_initialized():
        raise ValueError("apply_ep needs a running process group (call torsh_distributed.init())")
    group = group if group is not None else dist.group.WORLD
    assert group is not None
    device_type = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    return DeviceMesh.from_group(group, device_type)


def apply_ep(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Shard every :class:`~.moe.MoE` layer's experts over the ``ep`` ranks; in place.

    Rank ``r`` of the group keeps experts ``[r * E / ep, (r + 1) * E / ep)`` as new parameters,
    DTensors sharded ``Shard(0)`` over the ep mesh (:meth:`~.moe.GroupedExperts.shard_`; marked,
    see :func:`expert_parameters`), and dispatches tokens by all-to-all. Works on a meta-device
    model (then ``reset_parameters`` draws the local block's values of the unsharded
    initialisation). Apply before building the optimizer (with ``foreach=False``: see the module
    docstring) and before DDP/FSDP.

    Args:
        model: A model containing MoE layers (a model without any is returned unchanged).
        mesh: The 1-D ``ep`` mesh (``dims.mesh["ep"]``). Prefer it in a multi-axis layout: it
            names the right group for this rank.
        group: The ``ep`` process group instead of a mesh (wrapped in a 1-D mesh); neither =
            the world (pure EP).

    Returns:
        ``model``.

    Raises:
        ValueError: before any communication, when a layer's ``num_experts`` is not divisible
            by ``ep``, a layer is already sharded, or no process group runs.
    """
    mesh = _resolve_mesh(mesh, group)
    ep = mesh.size()
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    for name, layer in layers:
        num = layer.config.num_experts
        if num % ep:
            raise ValueError(
                f"num_experts ({num}) of MoE layer {name or '<root>'!r} must be divisible by "
                f"ep ({ep})"
            )
        if layer.experts.sharded or layer.dispatcher is not None:
            raise ValueError(f"MoE layer {name or '<root>'!r} is already expert-parallel")
    group = mesh.get_group()
    for _, layer in layers:
        layer.experts.shard_(mesh)
        setattr(layer.experts, _MARK, True)
        for p in layer.experts.parameters():
            setattr(p, _MARK, True)
        layer.dispatcher = ExpertDispatcher(group, ep=ep, num_experts=layer.config.num_experts)
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts sharded by :func:`apply_ep` (marked ``_torsh_expert``;
    DTensors sharded over the ep mesh).

    Found through their modules, so the list stays right after ``to_empty`` (which may replace
    parameter objects); the mark is set again on the ones returned.
    """
    found: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        if getattr(module, _MARK, False):
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    setattr(p, _MARK, True)
                    found.append(p)
    return found


@torch.no_grad()
def reduce_expert_grads(
    params: Iterable[nn.Parameter], *, group: dist.ProcessGroup | None, dp: int, ep: int
) -> None:
    """Turn expert gradients into the gradient of the mean loss over all ``dp * ep`` ranks.

    One flat all-reduce SUM per dtype over ``group`` (the expert-data-parallel group: the ``dp``
    ranks holding the same experts; skipped when ``dp == 1``), then a division by ``dp * ep``
    (the ``ep`` factor undoes the sum over ep ranks' tokens done by the all-to-all backward; see
    the module docstring). Parameters without a gradient are skipped; every rank of ``group``
    must pass the same parameters in the same order. DTensor gradients are reduced through
    their local shards (in place).

    Args:
        params: Expert parameters (:func:`expert_parameters`).
        group: The ``dp`` group (``dims.group("dp")``); ``None`` = the world.
        dp: Ranks in ``group``, checked against it when communicating.
        ep: Expert-parallel degree.

    Raises:
        ValueError: ``dp`` or ``ep`` below 1, or ``dp`` not the size of ``group``.
    """
    for name, value in (("dp", dp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if dp > 1:
        size = dist.get_world_size(group)
        if size != dp:
            raise ValueError(f"dp ({dp}) must equal the size of group ({size})")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            collectives.all_reduce(flat, group=group)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
    scale = 1.0 / (dp * ep)
    for g in grads:
        g.mul_(scale)


@torch.no_grad()
def update_moe_biases(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Apply one aux-loss-free balancing step to every MoE layer with ``bias_update_rate > 0``.

    Call after each optimizer step. The routed loads accumulated by the training forwards are
    summed over ``group`` (default: the world, i.e. every data-parallel rank including the ep
    ranks, whose tokens differ) in one all-reduce, so every replica moves its bias identically;
    without a running process group the local load is used.
    """
    layers = [m for m in moe_layers(model) if m.config.bias_update_rate > 0]
    if not layers:
        return
    loads = []
    for layer in layers:
        load = layer.load
        loads.append(
            load.float()
            if load is not None
            else torch.zeros(layer.config.num_experts, device=layer.expert_bias.device)
        )
    flat = torch.cat(loads)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        collectives.all_reduce(flat, group=group)
    for layer, load in zip(layers, torch.split(flat, [len(x) for x in loads]), strict=True):
        layer.update_bias(load)


@torch.no_grad()
def clip_grad_norm_with_experts_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    *,
    experts: Iterable[nn.Parameter],
    group: dist.ProcessGroup | None,
    dense_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm of a model whose experts are sharded over ``group`` (ep).

    Each ep rank holds other experts, so a local norm misses the rest and every rank would clip
    by a different factor (the replicas of the dense parameters would drift apart). The squares
    of the expert gradients are summed over ``group``; the dense ones, equal on every rank after
    the data-parallel average, count once (their local shards, for DTensors), unless
    ``dense_group`` is given: then each rank holds a shard of them (FSDP2 over the dp x ep
    ranks) and their squares are summed over it. Call after :func:`reduce_expert_grads`, on
    every rank of ``group``. ``max_norm <= 0`` only measures.

    Returns:
        The total norm before clipping, equal on every rank.
    """
    experts = list(experts)
    expert_ids = {id(p) for p in experts}
    with_grad = [p for p in params if p.grad is not None]
    grads = [_local(p.grad) for p in with_grad]  # type: ignore[arg-type]
    dense = [_local(p.grad) for p in with_grad if id(p) not in expert_ids]  # type: ignore[arg-type]
    local = [_local(p.grad) for p in experts if p.grad is not None]
    squares = torch.zeros(2, dtype=torch.float64)
    squares[0] = sum((g.double().pow(2).sum() for g in dense), torch.zeros((), dtype=torch.float64))
    squares[1] = sum((g.double().pow(2).sum() for g in local), torch.zeros((), dtype=torch.float64))
    expert_sq = squares[1:].clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(expert_sq, group=group)
    dense_sq = squares[:1].clone()
    if dense_group is not None and dist.get_world_size(dense_group) > 1:
        dist.all_reduce(dense_sq, group=dense_group)
    norm = (dense_sq[0] + expert_sq[0]).sqrt().float()
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm
