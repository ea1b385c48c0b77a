"""Apply the data-parallel strategies to a model, in one documented order.

Order (torchtitan's): **activation checkpointing** (wraps blocks; must see the plain blocks)
-> **(compile: not used)** -> **FSDP2** for stages 2-3 (shards each block, then the root; a
checkpoint-wrapped block is sharded as a whole; mixed precision is its MixedPrecisionPolicy) or
**autocast** (stages 0-1 with a 16-bit ``param_dtype``) then **DDP** (wraps the root; must be
last because it snapshots the parameters it will all-reduce). With meta-device
initialisation, FSDP2 shards the meta model and only the local shards are then allocated and
initialised; DDP needs real tensors, so for stages 0-1 the model is materialised first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.parallel.checkpointing import apply_ac
from torsh_distributed.parallel.config import ParallelConfig
from torsh_distributed.parallel.data import apply_ddp
from torsh_distributed.parallel.precision import apply_autocast
from torsh_distributed.parallel.sharded import apply_fsdp, dp_mesh, select_units

__all__ = ["parallelize", "build_parallel_model", "check_world"]


def check_world(config: ParallelConfig, world_size: int) -> None:
    """Reject settings that are meaningless at ``world_size``.

    Raises:
        ValueError: a ZeRO stage >= 1 with a single rank (there is nothing to shard across).
    """
    if config.zero_stage >= 1 and world_size < 2:
        raise ValueError(
            f"parallel.zero_stage {config.zero_stage} shards model states across data-parallel "
            f"ranks, but the world has {world_size} rank; use zero_stage 0 or launch >= 2 ranks"
        )


def _units(
    model: nn.Module, config: ParallelConfig, block_types: tuple[type[nn.Module], ...]
) -> list[nn.Module]:
    if config.wrap == "size":
        return select_units(model, min_params=config.wrap_min_params)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    units = [
        m
        for m in model.modules()
        if isinstance(m, CheckpointWrapper)
        and isinstance(m._checkpoint_wrapped_module, block_types)
    ]
    wrapped = {id(m._checkpoint_wrapped_module) for m in units}  # type: ignore[union-attr]
    units += [m for m in model.modules() if isinstance(m, block_types) and id(m) not in wrapped]
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(units, key=lambda m: order[id(m)], reverse=True)


def parallelize(
    model: nn.Module,
    config: ParallelConfig,
    *,
    device: torch.device,
    block_types: tuple[type[nn.Module], ...] = (),
    blocks_attr: str = "blocks",
) -> nn.Module:
    """Apply activation checkpointing, then FSDP2 (stages 2-3) or [autocast +] DDP (stages 0-1).

    Args:
        model: The model; its ``blocks_attr`` attribute (an ``nn.ModuleList``) holds the repeated
            blocks that are checkpointed and sharded as units.
        config: The ``parallel`` section.
        device: This rank's device (the mesh's device type).
        block_types: Module types of the FSDP units for ``wrap=block`` (default: the types of
            the modules in ``model.<blocks_attr>``).
        blocks_attr: Attribute naming the block list.

    Returns:
        The module to call for forward: a DDP wrapper for stages 0-1 (the optimizer must still be
        built over ``model``'s parameters), ``model`` itself for stages 2-3.

    Raises:
        ValueError: ZeRO stage >= 1 without a process group of >= 2 ranks, or no block list.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_world(config, world)
    blocks = getattr(model, blocks_attr, None)
    if config.checkpoint_every or config.wrap == "block":
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"model.{blocks_attr} must be an nn.ModuleList of blocks")
        block_types = block_types or tuple({type(b) for b in blocks})
    if config.checkpoint_every:
        apply_ac(blocks, every=config.checkpoint_every)  # type: ignore[arg-type]
    if config.zero_stage <= 1:
        if config.param_dtype != "fp32":  # DDP has no public mixed precision: autocast
            apply_autocast(model, dtype=config.param_dtype, device_type=device.type)
        return apply_ddp(model)
    return apply_fsdp(
        model,
        dp_mesh(device),
        stage=config.zero_stage,
        units=_units(model, config, block_types),
        param_dtype=config.param_dtype,
        reduce_dtype=config.reduce_dtype,
        offload=config.offload,
    )


def _materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    model.to_empty(device=device)
    torch.manual_seed(seed)
    init = getattr(model, "reset_parameters", None)
    if init is None:
        raise ValueError("meta_init needs a model with reset_parameters()")
    init()


def build_parallel_model(
    factory: Callable[[], nn.Module],
    config: ParallelConfig,
    *,
    device: torch.device,
    seed: int,
    blocks_attr: str = "blocks",
) -> tuple[nn.Module, nn.Module]:
    """Build ``factory()`` and parallelize it; returns ``(model, forward_module)``.

    Without ``config.meta_init`` the model is built on ``device`` under the caller's RNG state
    (identical on every rank) — the same values as an unsharded run. With it, the model is built
    on ``meta``, sharded, and only local shards are allocated, then ``reset_parameters()`` runs
    under ``seed`` (for FSDP2 on the sharded DTensors).
    """
    if not config.meta_init:
        model = factory().to(device)
        return model, parallelize(model, config, device=device, blocks_attr=blocks_attr)
    with torch.device("meta"):
        model = factory()
    if config.zero_stage <= 1:
        _materialise(model, device, seed)
        return model, parallelize(model, config, device=device, blocks_attr=blocks_attr)
    forward = parallelize(model, config, device=device, blocks_attr=blocks_attr)
    _materialise(model, device, seed)
    return model, forward
