"""Sharded data parallelism (ZeRO stages 1-3) on torch's own sharding.

=====  ===========================================  ============================================
stage  what is sharded                              built on
=====  ===========================================  ============================================
0      nothing                                      ``DistributedDataParallel`` (:mod:`.data`)
1      optimizer state                              DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer``
2      + gradients                                  FSDP2 ``fully_shard(reshard_after_forward=False)``
3      + parameters                                 FSDP2 ``fully_shard(reshard_after_forward=True)``
=====  ===========================================  ============================================

Why ZeRO-1 is not FSDP2: FSDP2 always reduce-scatters gradients into shards, so it has no mode
that keeps full gradients while sharding only the optimizer state. torch's sharded-optimizer
support for exactly that is ``ZeroRedundancyOptimizer`` over DDP: every rank all-reduces full
gradients (as DDP), steps the optimizer for the parameters it owns, then broadcasts them. It
partitions whole parameters (greedily by size), so per-rank optimizer state is uneven by up to
one parameter's state; :mod:`.memory` reports the imbalance.

Stage 2 on FSDP2 keeps the parameters gathered from forward until each unit's backward and
reshards after backward; between steps only shards are held (see docs/sharding.md for how this
differs from the paper's ZeRO-2, which keeps replicated parameters at all times).

:func:`quantize_collectives` (machinery in :mod:`._quantized_zero`) gives the FSDP2 units int8
block-quantised all-gather and reduce-scatter (ZeRO++'s qwZ / qgZ; ``--compression int8`` at
stages 2-3): about 3.9x fewer bytes in both collectives.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from torsh_distributed.parallel._quantized_zero import QuantStats, quantize_collectives

__all__ = [
    "DTYPES",
    "QuantStats",
    "apply_fsdp",
    "quantize_collectives",
    "select_units",
    "shard_optimizer",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def select_units(
    model: nn.Module,
    *,
    module_types: tuple[type[nn.Module], ...] = (),
    min_params: int | None = None,
) -> list[nn.Module]:
    """FSDP units below the root, innermost first.

    Args:
        model: The root module (never returned; it is always the last unit).
        module_types: Wrap modules of these types (the transformer block).
        min_params: Instead, wrap any submodule holding at least this many parameters that are
            not already in a unit below it (size policy).

    Raises:
        ValueError: neither or both policies given.
    """
    if bool(module_types) == (min_params is not None):
        raise ValueError("give exactly one of module_types or min_params")
    units: list[nn.Module] = []
    if module_types:
        units = [m for m in model.modules() if m is not model and isinstance(m, module_types)]
        return units[::-1]

    def visit(module: nn.Module) -> int:
        free = sum(visit(child) for child in module.children())
        free += sum(p.numel() for p in module.parameters(recurse=False))
        # containers without forward (ModuleList) cannot be units: their params go up a level
        has_forward = type(module).forward is not nn.Module.forward
        if module is not model and has_forward and free >= min_params:
            units.append(module)
            return 0
        return free

    visit(model)
    return units


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    stage: int,
    units: Sequence[nn.Module],
    param_dtype: str = "fp32",
    reduce_dtype: str = "fp32",
    offload: str = "none",
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 as ZeRO ``stage`` 2 or 3 and return it.

    Each of ``units`` becomes one FSDP unit (one all-gather / reduce-scatter each), then the root
    takes the remaining parameters.

    Args:
        model: Root module, on the mesh's device or on ``meta``.
        mesh: 1-D data-parallel mesh.
        stage: 2 = keep parameters gathered from forward to backward (one all-gather per step,
            more memory); 3 = reshard after forward and re-gather in backward (least memory,
            one more all-gather).
        units: Submodules to shard as separate units, innermost first (:func:`select_units`).
        param_dtype: Dtype of gathered parameters (``bf16``/``fp16`` = mixed precision; shards stay
            fp32; fp16 needs loss scaling, :class:`.precision.LossScaler`).
        reduce_dtype: Dtype of the gradient reduce-scatter.
        offload: ``cpu`` = torch's CPUOffloadPolicy (shards and the optimizer step on the host).
        ignored_params: Parameters FSDP2 leaves alone (neither sharded nor reduced): the
            experts of an expert-parallel model, which other ranks hold other values of.

    Raises:
        ValueError: stage is not 2 or 3, or an unknown dtype / offload.
    """
    if stage not in (2, 3):
        raise ValueError(f"apply_fsdp implements ZeRO stages 2 and 3, got {stage}")
    if param_dtype not in DTYPES or reduce_dtype not in DTYPES:
        raise ValueError(f"dtypes must be one of {', '.join(DTYPES)}")
    if offload not in ("none", "cpu"):
        raise ValueError(f"offload must be none or cpu, got {offload!r}")
    policy: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if offload == "cpu"
        else OffloadPolicy()
    )
    mixed = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    kwargs = {"mesh": mesh, "reshard_after_forward": stage == 3, "offload_policy": policy}
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    if param_dtype != "fp32" or reduce_dtype != "fp32":
        kwargs["mp_policy"] = mixed
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    stage: int,
    process_group: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """The optimizer for ZeRO ``stage``: stage 1 re-creates it as a ZeroRedundancyOptimizer.

    Stages 0, 2 and 3 return ``optimizer`` unchanged (under FSDP2 it already sees only shards).
    For stage 1 the parameter groups and hyper-parameters of ``optimizer`` (which must not have
    stepped yet) are handed to torch's ``ZeroRedundancyOptimizer``, which owns a local optimizer
    of the same class for this rank's partition.

    Raises:
        ValueError: ``optimizer`` already has state (it would be dropped).
    """
    if stage != 1:
        return optimizer
    if optimizer.state:
        raise ValueError("shard_optimizer needs a fresh optimizer (it has state already)")
    # imported here: torch.distributed.optim scripts its functional optimizers with the deprecated
    # torch.jit.script on import (~20 DeprecationWarnings and seconds of start-up), which
    # everything else importing this module (the model, `torsh-dist serve`) does not need
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [
        {k: v for k, v in group.items() if k == "params" or k in accepted}
        for group in optimizer.param_groups
    ]
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=cls, process_group=process_group, **defaults
    )
