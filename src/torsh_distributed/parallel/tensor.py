"""Tensor parallelism of the built-in transformer on torch's DTensor ``parallelize_module``.

Megatron's layout: in every block the attention's fused ``qkv`` and the MLP's ``up`` projection
are column-parallel (each rank computes its own heads / its slice of the hidden layer, no
communication), ``proj`` and ``down`` are row-parallel (one all-reduce of the block output each).
The token embedding is vocabulary-parallel (row-wise on the vocabulary dimension, an all-reduce of
the looked-up rows) and the output head column-parallel; with ``loss_parallel`` the logits stay
sharded over the vocabulary and the cross-entropy is computed by torch's ``loss_parallel`` without
gathering them. Without sequence parallelism, norms, position embeddings and biases of
row-parallel layers stay replicated (plain tensors or ``Replicate`` DTensors) and their gradients
are identical on every rank of the ``tp`` axis.

The fused ``qkv`` weight holds rows ``[q | k | v]``; a contiguous column shard would give rank 0
all of ``q`` and part of ``k``. :func:`apply_tp` therefore permutes its rows (and bias) so that
each rank's contiguous shard is ``[q_r | k_r | v_r]`` for its own heads. The permutation is a
fixed re-ordering of the initial values, so the computation is that of the unsharded model, but
a TP model's ``state_dict`` is laid out per rank (use :func:`qkv_permutation` to convert).

Sequence parallelism (Megatron-SP, ``sequence_parallel=True``) additionally shards the activations
*between* the tensor-parallel regions over the sequence dimension: the residual stream, both
LayerNorms of every block, the final norm and the dropouts hold ``seq / tp`` positions per rank
(``Shard(1)``). Each column-parallel entry (``qkv``, ``up``, ``head``) all-gathers its normalised
input over the sequence, and each row-parallel exit (``proj``, ``down``, the embedding)
reduce-scatters its partial sums over the sequence instead of all-reducing them: the same bytes
on the wire (an all-reduce is a reduce-scatter plus an all-gather), and the norms' inputs and
dropout masks saved for backward shrink ``tp`` times (DTensor's column-parallel linear still
saves its all-gathered input whole; Megatron saves the shard and gathers it again in backward).
Norm weights become ``Replicate`` DTensors (torch's ``SequenceParallel`` style), but their
gradients come out of backward as ``Partial(sum)`` (each rank saw only its positions):
:func:`reduce_partial_grads` sums them over the ``tp`` axis in one flat all-reduce before the
optimizer. The position embedding stays a plain tensor: its output is split over the sequence
locally (no communication; the backward all-gathers its gradient, identical on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "apply_tp",
    "check_tp",
    "qkv_permutation",
    "clip_grad_norm_",
    "reduce_partial_grads",
    "sync_grads",
    "average_replicated_grads",
]


def check_tp(
    *,
    tp: int,
    n_head: int,
    d_model: int,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    block_size: int | None = None,
) -> None:
    """Reject shapes that do not shard evenly over ``tp`` ranks (before any collective).

    Args:
        tp: Tensor-parallel degree.
        n_head: Attention heads (the unit of sharding of the attention).
        d_model: Model width (the MLP is ``4 * d_model`` wide).
        vocab_size: Vocabulary (embedding and head rows); ``None`` skips the check.
        sequence_parallel: Whether the sequence dimension is sharded too.
        block_size: Sequence length, checked with ``sequence_parallel``.

    Raises:
        ValueError: ``n_head``, the MLP width, ``vocab_size`` or (sequence parallel)
            ``block_size`` not divisible by ``tp``; sequence parallelism with ``tp < 2``.
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
    if sequence_parallel:
        if tp < 2:
            raise ValueError(
                f"parallel.sequence_parallel needs parallel.tp > 1 (it shards the sequence over "
                f"the tp axis); got tp={tp}"
            )
        if block_size is not None and block_size % tp:
            raise ValueError(
                f"parallel.sequence_parallel needs parallel.tp={tp} to divide "
                f"model.block_size={block_size}: each rank holds block_size / tp positions"
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


def _block_plan(sequence_parallel: bool) -> dict[str, object]:
    if not sequence_parallel:
        return {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(),
        }
    # The norms' outputs stay Shard(1) DTensors (use_local_output=False) so that the attention
    # sees the global sequence length in x.shape; qkv/up all-gather them to Replicate.
    seq = Shard(1)
    return {
        "ln1": SequenceParallel(),
        "attn.qkv": ColwiseParallel(input_layouts=seq),
        "attn.proj": RowwiseParallel(output_layouts=seq),
        "ln2": SequenceParallel(),
        "mlp.up": ColwiseParallel(input_layouts=seq),
        "mlp.down": RowwiseParallel(output_layouts=seq),
    }


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
    blocks_attr: str = "blocks",
) -> nn.Module:
    """Shard ``model``'s blocks, embedding and head over the 1-D ``mesh`` (the ``tp`` axis), in place.

    Works on the whole :class:`~torsh_distributed.models.gpt.GPT` and on a pipeline stage of it
    (only the parts the module has are sharded: ``tok_emb``, ``pos_emb``, ``blocks``, ``ln_f``,
    ``head``).

    Args:
        model: A GPT (or a stage) with real parameters, identical on every rank of ``mesh``.
        mesh: The tensor-parallel mesh (e.g. ``ParallelDims.mesh["tp"]``).
        loss_parallel: Keep the logits sharded over the vocabulary (a ``DTensor``) so that the
            cross-entropy runs under :func:`torch.distributed.tensor.parallel.loss_parallel`
            without gathering ``batch x seq x vocab`` logits; the caller must run forward *and*
            backward inside that context. Off: the head all-gathers plain logits (simple, more
            memory and traffic).
        sequence_parallel: Megatron-SP: the residual stream, norms and dropouts between the
            tensor-parallel regions hold ``seq / tp`` positions per rank, so their activations
            take ``tp`` times less memory, for the same communication volume (a reduce-scatter
            and an all-gather per sub-layer instead of an all-reduce). The activations a stage
            passes to the next (``pp > 1``) are then sequence shards. Needs ``tp > 1`` and a
            sequence length divisible by ``tp``.
        blocks_attr: Attribute holding the ``nn.ModuleList`` of blocks.

    Returns:
        ``model``.

    Raises:
        ValueError: a shape not divisible by the mesh size, no block list, or
            ``sequence_parallel`` on a mesh of one rank.
    """
    tp = mesh.size()
    blocks = getattr(model, blocks_attr, None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"model.{blocks_attr} must be an nn.ModuleList of blocks")
    if sequence_parallel and tp < 2:
        raise ValueError(f"sequence_parallel needs a tensor-parallel mesh of >= 2 ranks, got {tp}")
    if tp == 1:
        return model
    for block in blocks:
        attn = block.attn
        check_tp(tp=tp, n_head=attn.n_head, d_model=attn.qkv.in_features)
        _permute_qkv(attn.qkv, tp)
        parallelize_module(block, mesh, _block_plan(sequence_parallel))
    # the layout of the residual stream between the tensor-parallel regions
    stream = Shard(1) if sequence_parallel else Replicate()
    emb = getattr(model, "tok_emb", None)
    if isinstance(emb, nn.Embedding):
        if emb.num_embeddings % tp:
            raise ValueError(f"vocab_size {emb.num_embeddings} is not divisible by tp={tp}")
        parallelize_module(
            emb, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        )
    pos = getattr(model, "pos_emb", None)
    if sequence_parallel and isinstance(pos, nn.Embedding):
        # (seq, d) -> this rank's (seq / tp, d) rows: a local split, to add to the token
        # embedding's sequence shard; the backward all-gathers the gradient
        parallelize_module(
            pos,
            mesh,
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
        )
    norm = getattr(model, "ln_f", None)
    if sequence_parallel and isinstance(norm, nn.LayerNorm):
        parallelize_module(norm, mesh, SequenceParallel())
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        if head.out_features % tp:
            raise ValueError(f"vocab_size {head.out_features} is not divisible by tp={tp}")
        style = (
            ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
            if loss_parallel
            else ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
        )
        parallelize_module(head, mesh, style)
    return model


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
    the axes they are sharded over.

    Args:
        reduce: Replaces the all-reduce: ``reduce(flat, owners)`` returns the mean of ``flat``
            (the local gradients of ``owners``, concatenated) over the group (compression).
    """
    if size <= 1:
        return
    owners = [p for p in params if p.grad is not None]
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
