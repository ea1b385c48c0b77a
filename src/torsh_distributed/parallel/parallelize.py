"""Apply every parallelism to a model, in one documented order: the one composition path.

:func:`parallelize` changes a model in place and returns the module to call for forward. The
order (torchtitan's, for the same reasons):

1. **Tensor / sequence parallelism by plan** (:func:`~.tp_plan.apply_tp_plan` over the ``tp``
   mesh axis): it must see the plain modules (their types and names) and its DTensors are what
   FSDP then shards over ``dp`` (a 2-D layout).
2. **Expert parallelism** (:func:`~.expert.apply_ep`): every MoE layer keeps its ``num_experts /
   ep`` experts of this rank of the ``ep`` axis and exchanges tokens by all-to-all; before
   checkpointing (which must see the dispatching layer) and before DDP or FSDP2, which then
   average (DDP) or shard and reduce-scatter (FSDP2, over :meth:`ParallelDims.data_mesh`) only
   the dense parameters over the ``dp * ep`` data-parallel ranks; the experts stay out of them
   (sharded over ``ep``, replicated over ``dp``) and their gradients are reduced over their
   ``dp`` group by :func:`~.expert.reduce_expert_grads`.
3. **Activation checkpointing** of the repeated blocks (every block or every k-th): wraps blocks,
   so it must come after TP (which addresses modules inside them) and before FSDP (which shards
   a checkpoint-wrapped block as one unit).
4. **torch.compile** of each block (optional): compiles what the block computes, checkpointing
   included; FSDP's hooks stay outside the compiled region.
5. **Data parallelism**, last because it snapshots the parameters it will synchronise:
   FSDP2 over the ``dp`` axis for ZeRO stages 2-3 (each block a unit, then the root; mixed
   precision is its ``MixedPrecisionPolicy``), or for stages 0-1 ``autocast`` (16-bit
   ``param_dtype``) then DDP over the ``dp`` group. DDP wraps only plain data parallelism: a
   tensor-parallel model or a pipeline stage is not wrapped, and its dp gradients are averaged
   by one flat all-reduce after backward (:func:`~.tensor.sync_grads`, which the engine calls and
   gradient compression can replace).

Pipeline parallelism builds stages (:mod:`.pipeline`) and calls this per stage. With meta-device
initialisation, :func:`materialize` allocates and initialises after sharding (FSDP2, TP) or
before wrapping (DDP needs real tensors): the engine decides which with :func:`materialize_first`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.nn.parallel import DistributedDataParallel

from torsh_distributed.comm.dims import ParallelDims
from torsh_distributed.parallel.blocks import block_entries, find_blocks
from torsh_distributed.parallel.checkpointing import apply_ac
from torsh_distributed.parallel.config import ParallelConfig, check_world
from torsh_distributed.parallel.data import DDPOptions, apply_ddp
from torsh_distributed.parallel.expert import apply_ep, expert_parameters
from torsh_distributed.parallel.precision import apply_autocast
from torsh_distributed.parallel.sharded import apply_fsdp, select_units
from torsh_distributed.parallel.tp_plan import TPPlan, apply_tp_plan

__all__ = [
    "parallelize",
    "materialize",
    "materialize_first",
    "check_init_coverage",
    "check_world",
    "ddp_options",
]


def ddp_options(config: ParallelConfig) -> DDPOptions:
    """DDP's wrapper options from the ``parallel`` section."""
    return DDPOptions(
        bucket_cap_mb=config.bucket_cap_mb,
        first_bucket_mb=config.first_bucket_mb,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        find_unused_parameters=config.find_unused_parameters,
        init_sync=config.init_sync,
    )


def _fsdp_units(model: nn.Module, config: ParallelConfig, blocks: str | None) -> list[nn.Module]:
    if config.wrap == "size":
        return select_units(model, min_params=config.wrap_min_params)
    try:
        _, container = find_blocks(model, blocks)
    except ValueError:
        warnings.warn(
            f"{type(model).__name__} has no container of repeated blocks: the whole model is one "
            "FSDP unit (parallel.wrap=size gives smaller units)",
            stacklevel=3,
        )
        return []
    return [m for _, m in block_entries(container)][::-1]  # innermost (last) first


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    *,
    tp_plan: TPPlan | Mapping[str, str | ParallelStyle] | None = None,
    strict_plan: bool = True,
    pipeline_stage: bool = False,
    blocks: str | None = None,
    device: torch.device | None = None,
    ddp: bool = True,
) -> nn.Module:
    """Apply TP/SP -> (EP) -> activation checkpointing -> compile -> FSDP2 or DDP, in place.

    Args:
        model: The model (or a pipeline stage of it), on its device or on ``meta``.
        dims: Built :class:`~torsh_distributed.comm.dims.ParallelDims` (meshes and groups).
        config: The ``parallel`` section.
        tp_plan: How to shard over ``tp`` (required when ``dims.tp > 1``).
        strict_plan: Every plan pattern must match a module; ``False`` for pipeline stages,
            which hold only part of the model (validate the plan on the whole model first).
        pipeline_stage: ``model`` is a pipeline stage: no DDP wrapper (the engine averages the
            dp gradients once per step, after the schedule).
        blocks: Qualified name of the container of repeated blocks (checkpointing and FSDP
            units); ``None`` = found by :func:`~.blocks.find_blocks`.
        device: The mesh's device (default: the first parameter's).
        ddp: ``False`` leaves plain data parallelism unwrapped, also at ZeRO stage 2 (no
            FSDP2): the caller exchanges the gradients itself (``--comm-schedule priority``:
            :mod:`~.priority`, which shards stage 2 by itself).

    Returns:
        The module to call for forward: a DDP wrapper for plain data parallelism at stages 0-1
        with dp > 1 (build the optimizer over ``model``'s parameters), else ``model``.

    Raises:
        ValueError: tp > 1 without a plan, ep > 1 without MoE layers (or ``num_experts`` not
            divisible by ep), checkpointing without blocks, a bad plan.
    """
    device = device or next(model.parameters()).device
    model_parallel = dims.tp > 1 or pipeline_stage
    # 1. tensor / sequence parallelism
    if tp_plan is not None:
        apply_tp_plan(model, dims.mesh["tp"], tp_plan, strict=strict_plan)
    elif dims.tp > 1:
        raise ValueError(f"tp={dims.tp} needs a tensor-parallel plan (tp_plan=TPPlan(...))")
    # 2. expert parallelism
    experts: list[str] = []
    if dims.ep > 1:
        apply_ep(model, dims.mesh["ep"])
        local = {id(p) for p in expert_parameters(model)}
        experts = [n for n, p in model.named_parameters() if id(p) in local]
    # 3. activation checkpointing
    if config.checkpoint_every:
        _, container = find_blocks(model, blocks)
        apply_ac(container, every=config.checkpoint_every)
    # 4. compile each block (after checkpointing: the recomputation is compiled too)
    if config.compile:
        _, container = find_blocks(model, blocks)
        for _, block in block_entries(container):
            block.compile()
    # 5. data parallelism (ddp=False at stage 2: the priority exchange shards by itself)
    if config.zero_stage >= 2 and (ddp or config.zero_stage > 2):
        # ep > 1: dense parameters sharded over the dp x ep ranks; the experts stay out of FSDP
        # (sharded over ep, replicated over dp, their gradients reduced by reduce_expert_grads)
        return apply_fsdp(
            model,
            dims.data_mesh(),
            stage=config.zero_stage,
            units=_fsdp_units(model, config, blocks),
            param_dtype=config.param_dtype,
            reduce_dtype=config.reduce_dtype,
            offload=config.offload,
            ignored_params=set(expert_parameters(model)) if experts else None,
        )
    if config.param_dtype != "fp32":  # DDP has no public mixed precision: autocast
        apply_autocast(model, dtype=config.param_dtype, device_type=device.type)
    if model_parallel or dims.data_degree == 1 or not ddp:
        return model
    if experts:  # each ep rank holds other experts: DDP must neither broadcast nor average them
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    group = None if dims.data_degree == dims.world_size else dims.data_group()
    return apply_ddp(model, process_group=group, options=ddp_options(config))


def materialize_first(config: ParallelConfig, *, model_parallel: bool) -> bool:
    """Whether a meta-device model must be materialised before :func:`parallelize` (DDP wraps
    real tensors) rather than after (FSDP2 and TP shard meta tensors, then only local shards
    are allocated)."""
    return config.zero_stage <= 1 and not model_parallel


def _own_reset(module: nn.Module) -> bool:
    """Whether ``module``'s class (not FSDP2's generated wrapper class) defines reset_parameters."""
    return any(
        "reset_parameters" in cls.__dict__
        for cls in type(module).__mro__
        if cls is not nn.Module and not cls.__name__.startswith("FSDP")
    )


def check_init_coverage(model: nn.Module) -> None:
    """Raise unless every parameter and buffer of ``model`` is (re)set by a ``reset_parameters``.

    :func:`materialize` allocates uninitialised memory and relies on them; run this on the whole
    (meta) model before any collective, so that every rank raises the same error.

    Raises:
        ValueError: naming the parameters or buffers nothing initialises.
    """
    if _own_reset(model):
        return  # the model's own initialisation: trusted to set what it owns
    covered: set[int] = set()
    for module in model.modules():
        if _own_reset(module):
            covered.update(id(t) for t in module.parameters())
            covered.update(id(t) for t in module.buffers())
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    missing += [n for n, b in model.named_buffers() if id(b) not in covered]
    if missing:
        raise ValueError(
            f"meta_init: no reset_parameters() initialises {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; give {type(model).__name__} a "
            "reset_parameters() that sets them (a meta-device model has no values to keep)"
        )


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, *, seed: int) -> None:
    """Allocate a meta-device (possibly sharded) model on ``device`` and initialise it.

    Runs ``model.reset_parameters()`` if the root defines it (the model's own initialisation),
    else every submodule's own ``reset_parameters`` (torch's layers define one), under ``seed``.
    Sharded parameters are initialised shard by shard: where DTensor has no distributed RNG
    (CPU meshes in torch 2.13) the caller must give each shard its own ``seed``.

    Raises:
        ValueError: some parameter or buffer would stay uninitialised (:func:`check_init_coverage`).
    """
    check_init_coverage(model)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    if _own_reset(model):
        model.reset_parameters()  # type: ignore[operator]
        return
    for module in model.modules():
        if _own_reset(module):
            module.reset_parameters()  # type: ignore[operator]
