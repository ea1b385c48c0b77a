"""The built-in GPT's tensor-parallel plan (Megatron's layout, optionally with sequence parallelism).

The GPT is sharded over the ``tp`` mesh axis like any other model, by a
:class:`~torsh_distributed.parallel.tp_plan.TPPlan`; :func:`gpt_tp_plan` builds it.

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
all of ``q`` and part of ``k``. The plan's ``prepare`` step therefore permutes its rows (and bias)
so that each rank's contiguous shard is ``[q_r | k_r | v_r]`` for its own heads. The permutation
is a fixed re-ordering of the initial values, so the computation is that of the unsharded model,
but a TP model's ``state_dict`` is laid out per rank (use
:func:`~torsh_distributed.parallel.tensor.qkv_permutation` to convert).

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
:func:`~torsh_distributed.parallel.tensor.reduce_partial_grads` sums them over the ``tp`` axis in
one flat all-reduce before the optimizer. The position embedding stays a plain tensor: its output
is split over the sequence locally (no communication; the backward all-gathers its gradient,
identical on every rank). The activations a pipeline stage passes to the next are then sequence
shards.

The same plan applies to the whole GPT and to a pipeline stage of it (whatever subset of
``tok_emb``, ``pos_emb``, ``blocks``, ``ln_f`` and ``head`` it holds) with ``strict=False``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from torsh_distributed.models.config import ModelConfig
from torsh_distributed.parallel.tensor import qkv_permutation
from torsh_distributed.parallel.tp_plan import TPPlan

__all__ = ["gpt_tp_plan", "check_gpt_tp", "permute_qkv"]

_ATTN = re.compile(r"blocks\.[^.]+\.attn\Z")
_QKV = re.compile(r"blocks\.[^.]+\.attn\.qkv\Z")
_UP = re.compile(r"blocks\.[^.]+\.mlp\.up\Z")


def _check_shapes(
    *,
    tp: int,
    sequence_parallel: bool,
    n_head: int | None = None,
    mlp_width: int | None = None,
    vocab_size: int | None = None,
    block_size: int | None = None,
) -> None:
    """The GPT's divisibility rules for ``tp`` ranks; ``None`` skips a dimension."""
    if tp < 1:
        raise ValueError(f"parallel.tp must be >= 1, got {tp}")
    if n_head is not None and n_head % tp:
        raise ValueError(
            f"parallel.tp={tp} must divide model.n_head={n_head}: attention heads are the unit "
            f"of tensor parallelism"
        )
    if mlp_width is not None and mlp_width % tp:
        raise ValueError(f"parallel.tp={tp} must divide the MLP width 4*d_model={mlp_width}")
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


def check_gpt_tp(config: ModelConfig, *, tp: int, sequence_parallel: bool) -> None:
    """Reject GPT shapes that do not shard evenly over ``tp`` ranks (no model, no collective).

    Args:
        config: The GPT's shape.
        tp: Tensor-parallel degree.
        sequence_parallel: Whether the sequence dimension is sharded too (then ``tp`` must
            divide ``block_size`` and be at least 2).

    Raises:
        ValueError: ``tp < 1``; ``n_head``, the MLP width ``4 * d_model``, ``vocab_size`` or
            (sequence parallel) ``block_size`` not divisible by ``tp``; sequence parallelism
            with ``tp < 2``.
    """
    _check_shapes(
        tp=tp,
        sequence_parallel=sequence_parallel,
        n_head=config.n_head,
        mlp_width=4 * config.d_model,
        vocab_size=config.vocab_size,
        block_size=config.block_size,
    )


def _check_module(module: nn.Module, tp: int, *, sequence_parallel: bool) -> None:
    """:func:`check_gpt_tp`'s rules on the parts a GPT (or a pipeline stage of it) holds."""

    def first(values: Iterator[int]) -> int | None:
        return next(values, None)

    named = list(module.named_modules())
    _check_shapes(
        tp=tp,
        sequence_parallel=sequence_parallel,
        n_head=first(m.n_head for n, m in named if _ATTN.match(n) and hasattr(m, "n_head")),
        mlp_width=first(
            m.out_features for n, m in named if _UP.match(n) and isinstance(m, nn.Linear)
        ),
        vocab_size=first(
            m.num_embeddings if isinstance(m, nn.Embedding) else m.out_features
            for n, m in named
            if n in ("tok_emb", "head") and isinstance(m, (nn.Embedding, nn.Linear))
        ),
        block_size=first(
            m.num_embeddings for n, m in named if n == "pos_emb" and isinstance(m, nn.Embedding)
        ),
    )


@torch.no_grad()
def permute_qkv(module: nn.Module, tp: int) -> None:
    """Re-order the rows of every ``blocks.<i>.attn.qkv`` that ``module`` holds, in place, so
    that rank ``r``'s contiguous shard of ``tp`` is ``[q_r | k_r | v_r]`` (its own heads).

    The plan's ``prepare`` step; undo with ``qkv_permutation(d_model, tp).argsort()``.
    """
    for name, linear in module.named_modules():
        if not (_QKV.match(name) and isinstance(linear, nn.Linear)):
            continue
        perm = qkv_permutation(linear.in_features, tp).to(linear.weight.device)
        linear.weight.copy_(linear.weight[perm])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[perm])


def gpt_tp_plan(*, sequence_parallel: bool = False, loss_parallel: bool = False) -> TPPlan:
    """The tensor-parallel plan of :class:`~torsh_distributed.models.gpt.GPT` (see the module doc).

    Args:
        sequence_parallel: Megatron-SP: the residual stream, norms and dropouts between the
            tensor-parallel regions hold ``seq / tp`` positions per rank, so their activations
            take ``tp`` times less memory, for the same communication volume (a reduce-scatter
            and an all-gather per sub-layer instead of an all-reduce); norm gradients must then
            be summed over ``tp`` after backward
            (:func:`~torsh_distributed.parallel.tensor.reduce_partial_grads`). Needs ``tp > 1``
            and a sequence length divisible by ``tp``.
        loss_parallel: Keep the logits sharded over the vocabulary (a ``DTensor``) so that the
            cross-entropy runs under :func:`torch.distributed.tensor.parallel.loss_parallel`
            without gathering ``batch x seq x vocab`` logits; the caller must run forward *and*
            backward inside that context. Off: the head all-gathers plain logits (simple, more
            memory and traffic; what a pipeline's last stage needs).

    Returns:
        The plan; its ``check`` applies :func:`check_gpt_tp`'s rules to the model it is given,
        its ``prepare`` is :func:`permute_qkv`.
    """
    # the layout of the residual stream between the tensor-parallel regions
    stream = Shard(1) if sequence_parallel else Replicate()
    rules: dict[str, str | ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    }
    if sequence_parallel:
        # (seq, d) -> this rank's (seq / tp, d) rows: a local split, to add to the token
        # embedding's sequence shard; the backward all-gathers the gradient
        rules["pos_emb"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0)
        )
        # The norms' outputs stay Shard(1) DTensors (use_local_output=False) so that the
        # attention sees the global sequence length in x.shape; qkv/up all-gather them.
        for norm in ("blocks.*.ln1", "blocks.*.ln2", "ln_f"):
            rules[norm] = SequenceParallel()
    # column-parallel entries take the stream (all-gathered under SP), row-parallel exits give
    # it back (all-reduce, or reduce-scatter under SP)
    rules["blocks.*.attn.qkv"] = ColwiseParallel(input_layouts=stream)
    rules["blocks.*.attn.proj"] = RowwiseParallel(output_layouts=stream)
    rules["blocks.*.mlp.up"] = ColwiseParallel(input_layouts=stream)
    rules["blocks.*.mlp.down"] = RowwiseParallel(output_layouts=stream)
    rules["head"] = (
        ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel
        else ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    )
    return TPPlan(
        rules=rules,
        loss_parallel=loss_parallel,
        prepare=permute_qkv,
        check=partial(_check_module, sequence_parallel=sequence_parallel),  # picklable
    )
