"""Tensor parallelism of the built-in transformer on torch's DTensor ``parallelize_module``.

Megatron's layout: in every block the attention's fused ``qkv`` and the MLP's ``up`` projection
are column-parallel (each rank computes its own heads / its slice of the hidden layer, no
communication), ``proj`` and ``down`` are row-parallel (one all-reduce of the block output each).
The token embedding is vocabulary-parallel (row-wise on the vocabulary dimension, an all-reduce of
the looked-up rows) and the output head column-parallel; with ``loss_parallel`` the logits stay
sharded over the vocabulary and the cross-entropy is computed by torch's ``loss_parallel`` without
gathering them. Norms, position embeddings and biases of row-parallel layers stay plain
(replicated) tensors whose gradients are identical on every rank of the ``tp`` axis.

The fused ``qkv`` weight holds rows ``[q | k | v]``; a contiguous column shard would give rank 0
all of ``q`` and part of ``k``. :func:`apply_tp` therefore permutes its rows (and bias) so that
each rank's contiguous shard is ``[q_r | k_r | v_r]`` for its own heads. The permutation is a
fixed re-ordering of the initial values, so the computation is that of the unsharded model, but
a TP model's ``state_dict`` is laid out per rank (use :func:`qkv_permutation` to convert).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["apply_tp", "check_tp", "qkv_permutation", "clip_grad_norm_", "sync_grads"]


def check_tp(*, tp: int, n_head: int, d_model: int, vocab_size: int | None = None) -> None:
    """Reject shapes that do not shard evenly over ``tp`` ranks (before any collective).

    Raises:
        ValueError: ``n_head``, the MLP width or ``vocab_size`` not divisible by ``tp``.
    """
    if tp < 1:
        raise ValueError(f"parallel.tp must be >= 1, got {tp}")
    if n_head % tp:
        raise ValueError(
            f"parallel.tp={tp} must divide model.n_head={n_head}: attention heads are the unit "
            f"of tensor parallelism"
        )
    if (4 * d_model) % tp:
        raise ValueError(f"parallel.tp={tp} must divide the MLP width 4*d_model={4 * d_model}")
    if vocab_size is not None and vocab_size % tp:
        raise ValueError(
            f"parallel.tp={tp} must divide model.vocab_size={vocab_size} (vocabulary-parallel "
            f"embedding and head)"
        )


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


@torch.no_grad()
def _permute_qkv(linear: nn.Linear, tp: int) -> None:
    perm = qkv_permutation(linear.in_features, tp).to(linear.weight.device)
    linear.weight.copy_(linear.weight[perm])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[perm])


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    loss_parallel: bool = False,
    blocks_attr: str = "blocks",
) -> nn.Module:
    """Shard ``model``'s blocks, embedding and head over the 1-D ``mesh`` (the ``tp`` axis), in place.

    Works on the whole :class:`~torsh_distributed.train.model.GPT` and on a pipeline stage of it
    (only the parts the module has are sharded: ``tok_emb``, ``blocks``, ``head``).

    Args:
        model: A GPT (or a stage) with real parameters, identical on every rank of ``mesh``.
        mesh: The tensor-parallel mesh (e.g. ``ParallelDims.mesh["tp"]``).
        loss_parallel: Keep the logits sharded over the vocabulary (a ``DTensor``) so that the
            cross-entropy runs under :func:`torch.distributed.tensor.parallel.loss_parallel`
            without gathering ``batch x seq x vocab`` logits; the caller must run forward *and*
            backward inside that context. Off: the head all-gathers plain logits (simple, more
            memory and traffic).
        blocks_attr: Attribute holding the ``nn.ModuleList`` of blocks.

    Returns:
        ``model``.

    Raises:
        ValueError: a shape not divisible by the mesh size, or no block list.
    """
    tp = mesh.size()
    blocks = getattr(model, blocks_attr, None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"model.{blocks_attr} must be an nn.ModuleList of blocks")
    if tp == 1:
        return model
    for block in blocks:
        attn = block.attn
        check_tp(tp=tp, n_head=attn.n_head, d_model=attn.qkv.in_features)
        _permute_qkv(attn.qkv, tp)
        parallelize_module(
            block,
            mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.up": ColwiseParallel(),
                "mlp.down": RowwiseParallel(),
            },
        )
    emb = getattr(model, "tok_emb", None)
    if isinstance(emb, nn.Embedding):
        if emb.num_embeddings % tp:
            raise ValueError(f"vocab_size {emb.num_embeddings} is not divisible by tp={tp}")
        parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        if head.out_features % tp:
            raise ValueError(f"vocab_size {head.out_features} is not divisible by tp={tp}")
        style = (
            ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            if loss_parallel
            else ColwiseParallel(output_layouts=Replicate())
        )
        parallelize_module(head, mesh, style)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sync_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, size: int) -> None:
    """Average gradients over a data-parallel ``group`` of ``size`` ranks (one flat all-reduce).

    DTensor gradients are reduced through their local shards: the ``dp`` axis is orthogonal to
    the axes they are sharded over.
    """
    if size <= 1:
        return
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


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
