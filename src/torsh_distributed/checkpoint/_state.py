"""What a checkpoint of model and optimizer holds, and the host buffers async saves stage into.

Helpers of :mod:`~torsh_distributed.checkpoint.manager`: the reusable staging buffers, the
fingerprint that says when a cached state-dict view is still valid, and ZeRO-1's optimizer state
laid out by parameter name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import BlockingAsyncStager

__all__ = [
    "ReusedBuffersStager", "fingerprint", "is_zero1", "refill_hyperparameters", "zero1_optim_state",
]


class ReusedBuffersStager(BlockingAsyncStager):
    """Stage into host buffers allocated once and reused by later saves of the same structure.

    torch's caching stager pins its buffers, which needs an accelerator; pinning only helps
    device-to-host copies, so buffers are pinned only when CUDA is available.
    """

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=True)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(
                state_dict, pin_memory=torch.cuda.is_available()
            )
        return _copy_state_dict(state_dict, self.state_dict_cache)


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, ...]:
    """Identity of every tensor a checkpoint holds: equal iff a cached state-dict view is valid."""

    def ptr(tensor: torch.Tensor) -> int:
        return getattr(tensor, "_local_tensor", tensor).data_ptr()  # DTensor: its local shard

    ptrs = [ptr(t) for t in (*model.parameters(), *model.buffers())]
    if optimizer is not None:
        inner = optimizer.optim if is_zero1(optimizer) else optimizer  # type: ignore[attr-defined]
        for entries in inner.state.values():
            ptrs.extend(ptr(v) for v in entries.values() if torch.is_tensor(v))
        ptrs.append(len(inner.state))
    return (id(model), id(optimizer), tuple(ptrs))


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def zero1_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """ZeRO-1's optimizer state of this rank's partition, as ``{"state": {fqn: {key: tensor}}}``.

    ``ZeroRedundancyOptimizer`` keeps the state of a partition of whole parameters in an inner
    optimizer. Each parameter's state is saved once under its fully qualified name (the
    partitions are disjoint, DCP writes each key once); at another world size the partition
    differs and every rank reads the keys it now owns. The tensors returned are the optimizer's
    own, so ``dcp.load`` fills them in place. Hyper-parameters are not saved: the trainer sets
    them from its config (and the learning rate from the step) anyway. The layout is the
    ``state`` part of torch's optimizer state dict, so a DDP/FSDP checkpoint loads into ZeRO-1.
    """
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    inner = optimizer.optim  # type: ignore[attr-defined]
    _init_optim_state(inner)  # allocate state (zero-gradient step with lr 0) before loading
    module = model.module if hasattr(model, "module") else model
    names = {id(p): fqn for fqn, p in module.named_parameters()}
    state: dict[str, dict[str, Any]] = {}
    for param, entries in inner.state.items():
        state[names[id(param)]] = {
            key: value if torch.is_tensor(value) else torch.tensor(value)
            for key, value in entries.items()
        }
    return {"state": state}


def refill_hyperparameters(optimizer: torch.optim.Optimizer, hyper: list[dict[str, Any]]) -> None:
    """Put back param-group settings (lr, betas, ...) that loading dropped.

    DCP writes non-tensor values once, from the coordinator, as if every rank had the same ones.
    Pipeline ranks hold different parameters, so the settings keyed by another rank's parameter
    names do not come back; the run's own settings (from its config) fill them in.
    """
    for group, saved in zip(optimizer.param_groups, hyper, strict=True):
        for key, value in saved.items():
            group.setdefault(key, value)
