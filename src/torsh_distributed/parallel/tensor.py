"""Tensor-parallel helpers: the fused-qkv layout, gradient reductions and clipping over meshes.

Models are sharded over the ``tp`` mesh axis by a plan
(:func:`torsh_distributed.parallel.tp_plan.apply_tp_plan`; the built-in GPT's is
:func:`torsh_distributed.models.gpt_tp.gpt_tp_plan`). This module holds what a sharded model
needs around its step:

* :func:`qkv_permutation`: the row order that makes contiguous column shards of a fused
  ``[q | k | v]`` projection hold each rank's own heads (a plan's ``prepare`` step applies it;
  use it to convert a TP model's ``state_dict`` back).
* :func:`reduce_partial_grads`: after backward, bring DTensor gradients to their parameters'
  placements. Under sequence parallelism the norms' weights are ``Replicate`` but their
  gradients come out ``Partial(sum)`` (each rank saw only its positions): one flat all-reduce
  over the ``tp`` axis sums them before the optimizer.
* :func:`sync_grads` / :func:`average_replicated_grads`: the data-parallel gradient average of a
  model-parallel model (DDP does not wrap one), and the re-synchronisation of replicated
  parameters' gradients after a compressed exchange.
* :func:`clip_grad_norm_`: the global gradient norm over mesh axes and pipeline stages.
* :func:`num_params`: parameters of the unsharded model.

Without sequence parallelism, parameters a plan leaves alone (norms, position embeddings, biases
of row-parallel layers) stay replicated (plain tensors or ``Replicate`` DTensors) and their
gradients are identical on every rank of the ``tp`` axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "num_params",
    "qkv_permutation",
    "clip_grad_norm_",
    "reduce_partial_grads",
    "sync_grads",
    "average_replicated_grads",
]


def qkv_permutation(d_model: int, tp: int) -> torch.Tensor:
    """Row order of the fused qkv weight so that rank ``r``'s shard is ``[q_r | k_r | v_r]``.

    ``new = old[perm]``; ``old = new[perm.argsort()]`` undoes it.
    """
    part = d_model // tp
    rows = [
        torch.arange(which * d_model + r * part, which * d_model + (r + 1) * part)
        for r in range(tp)
        for which in range(3)
    ]
    return torch.cat(rows)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def reduce_partial_grads(params: Iterable[nn.Parameter]) -> None:
    """Bring every DTensor gradient to its parameter's placements, after backward.

    Under sequence parallelism a norm's weight is ``Replicate`` but each rank's gradient covers
    only its sequence shard, and DTensor leaves it ``Partial(sum)``. Left so, every optimizer op
    that touches it would all-reduce it implicitly (and clipping would see partial values). This
    sums all such gradients of a mesh in one flat all-reduce (Megatron's layer-norm all-reduce).
    Other mismatches are redistributed one by one: a ``Replicate`` gradient of a ``Shard``
    parameter (the vocabulary-parallel embedding's) is cut to the local shard without
    communication. FSDP2 already hands out gradients in their parameter's placements; then, and
    for plain tensors, nothing happens. Call it on every rank of the mesh with the same list.
    """
    pending: dict[int, tuple[DeviceMesh, list[nn.Parameter]]] = {}
    for p in params:
        g = p.grad
        if not (isinstance(p, DTensor) and isinstance(g, DTensor)) or g.placements == p.placements:
            continue
        mesh = g.device_mesh
        if mesh.ndim == 1 and g.placements[0].is_partial("sum") and p.placements[0].is_replicate():
            pending.setdefault(id(mesh), (mesh, []))[1].append(p)
        else:
            p.grad = g.redistribute(placements=p.placements)
    for mesh, group in pending.values():  # insertion order: the same on every rank
        shards = [p.grad.to_local() for p in group]  # type: ignore[union-attr]
        flat = torch.cat([t.reshape(-1) for t in shards])
        dist.all_reduce(flat, group=mesh.get_group())
        offset = 0
        for p, t in zip(group, shards, strict=True):
            local = flat[offset : offset + t.numel()].view_as(t)
            p.grad = DTensor.from_local(local, mesh, p.placements, run_check=False)
            offset += t.numel()


def sync_grads(
    params: Iterable[nn.Parameter],
    group: dist.ProcessGroup | None,
    size: int,
    *,
    reduce: Callable[[torch.Tensor, list[nn.Parameter]], torch.Tensor] | None = None,
) -> None:
    """Average gradients over a data-parallel ``group`` of ``size`` ranks (one flat all-reduce).

    DTensor gradients are reduced through their local shards: the ``dp`` axis is orthogonal to
    the axes they are sharded over. A trainable parameter without a gradient on this rank (its
    forward skipped it for this batch) gets a zero one, so every rank exchanges the same layout
    (differing flat sizes would fail or hang the all-reduce).

    Args:
        reduce: Replaces the all-reduce: ``reduce(flat, owners)`` returns the mean of ``flat``
            (the local gradients of ``owners``, concatenated) over the group (compression).
    """
    if size <= 1:
        return
    owners = [p for p in params if p.requires_grad]
    for p in owners:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    mean = None if reduce is None else (lambda flat: reduce(flat, owners))
    _mean_flat([_local(p.grad) for p in owners], group, size, mean)


def _mean_flat(
    grads: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    size: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Replace ``grads`` by their mean over ``group`` through one flat buffer (or ``reduce``)."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if reduce is not None:
        flat = reduce(flat)
    else:
        dist.all_reduce(flat, group=group)
        flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def average_replicated_grads(
    params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, size: int
) -> None:
    """Average over the ``tp`` ``group`` the gradients of parameters every rank of it holds whole.

    Needed after a *compressed* data-parallel exchange (:func:`sync_grads` with ``reduce``):
    TopK, int8, scaled sign and ``auto`` pick or scale over the whole flat tensor, which holds
    different TP shards on each tp rank, so the replicated parameters' gradients (norms, biases of
    row-parallel layers, position embedding) come back slightly different per tp rank, and the
    replicas would drift apart. One flat all-reduce makes them equal again (uncompressed exchanges
    never differ; skip it then). Call it on every rank of the group with the same list.
    """
    if size <= 1:
        return
    grads = [
        _local(p.grad)
        for p in params
        if p.grad is not None
        and not (isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements))
    ]
    _mean_flat(grads, group, size)


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip the global gradient norm of a model sharded over mesh axes and split over stages.

    DTensor gradients with the same mesh and placements are normed together by DTensor itself
    (``get_total_norm`` then ``full_tensor``: one reduction per group, over exactly the axes they
    are sharded on, tp and under FSDP dp); plain tensors are replicas and count once. The total is
    summed over ``pp_group`` (each stage owns its parameters). ``max_norm <= 0`` only measures.

    Summing squares of ``to_local()`` shards over the mesh groups by hand is wrong for FSDP2's
    ``_StridedShard`` x TP layout (it undercounted by half on torch 2.13), hence DTensor's own
    reduction.

    Returns:
        The total norm before clipping (a plain scalar tensor, equal on every rank).
    """
    params = [p for p in params if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else ()
        groups.setdefault(key, []).append(g)
    total = torch.zeros((), dtype=torch.float64)
    for key, grads in groups.items():  # insertion order: the same on every rank of a stage
        if not key:
            total += sum(float(g.double().pow(2).sum()) for g in grads)
            continue
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total += norm.double().cpu() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt().float()
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for p in params:
                _local(p.grad).mul_(coef)
    return norm


def num_params(model: nn.Module) -> int:
    """Parameters of the unsharded model (DTensors count their global size)."""
    return sum(math.prod(p.shape) for p in model.parameters())
