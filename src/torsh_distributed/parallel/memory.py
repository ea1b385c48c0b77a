"""Measured memory per rank: model states summed from the tensors held, and peak process memory.

Model states are counted from the storages actually alive, deduplicated by address:

* parameters: ``model.parameters()`` (for FSDP2 the local shard of each DTensor, whose storage
  includes the padding of uneven shards);
* gradients: every ``.grad`` (FSDP2's sharded gradients of a unit share one padded storage);
* optimizer state: the tensors in the (local, for ZeRO-1) optimizer's ``state``; per-parameter
  scalars such as Adam's ``step`` are reported apart as ``optimizer_scalars``.

``held`` is storage bytes, ``useful`` the bytes of the elements this rank owns; the difference is
shard padding. Current process memory comes from psutil; peak process memory is the kernel's
high-water mark of resident memory (``VmHWM`` in ``/proc/self/status``), which
:func:`reset_peak_rss` resets (``clear_refs`` = 5), both read by hand because psutil has neither;
on GPU, ``torch.cuda.max_memory_allocated`` as well.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

__all__ = [
    "StateBytes",
    "ModelStateMeasurement",
    "measure_model_state",
    "peak_rss_bytes",
    "current_rss_bytes",
    "reset_peak_rss",
    "cuda_peak_bytes",
]


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes of one category of model state on this rank."""

    held: int
    """Bytes of the storages alive (including shard padding)."""
    useful: int
    """Bytes of the elements this rank owns."""

    @property
    def padding(self) -> int:
        return self.held - self.useful


@dataclass(frozen=True, slots=True)
class ModelStateMeasurement:
    """Model states on this rank, as held."""

    params: StateBytes
    grads: StateBytes
    optimizer: StateBytes
    optimizer_scalars: int
    """Bytes of per-parameter scalar state (Adam's ``step``), not in the ZeRO formulas."""

    @property
    def total(self) -> int:
        return self.params.held + self.grads.held + self.optimizer.held

    @property
    def padding(self) -> int:
        return self.params.padding + self.grads.padding + self.optimizer.padding

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("params", "grads", "optimizer"):
            out[name] = getattr(self, name).held
        out["total"] = self.total
        out["padding"] = {n: getattr(self, n).padding for n in ("params", "grads", "optimizer")}
        out["optimizer_scalars"] = self.optimizer_scalars
        return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # DTensor
    return to_local() if callable(to_local) else tensor


def _count(tensors: list[torch.Tensor]) -> StateBytes:
    storages: dict[tuple[str, int], int] = {}
    useful = 0
    for tensor in tensors:
        local = _local(tensor)
        useful += local.numel() * local.element_size()
        if local.numel() == 0 and local.untyped_storage().nbytes() == 0:
            continue
        storage = local.untyped_storage()
        storages[(str(local.device), storage.data_ptr())] = storage.nbytes()
    return StateBytes(held=sum(storages.values()), useful=useful)


def measure_model_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> ModelStateMeasurement:
    """Count this rank's parameters, gradients and optimizer state (see module docstring).

    Call it after ``optimizer.step()`` while the gradients are still held (before
    ``zero_grad``), between steps. For FSDP2 stage 2, the unsharded working parameters are
    freed by then; they are transient, like DDP's gradient buckets.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    local_opt = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    states: list[torch.Tensor] = []
    scalars = 0
    for state in local_opt.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "step" or _local(value).dim() == 0 and value.numel() == 1:
                scalars += value.numel() * value.element_size()
            else:
                states.append(value)
    return ModelStateMeasurement(
        params=_count(params),
        grads=_count(grads),
        optimizer=_count(states),
        optimizer_scalars=scalars,
    )


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory since start or :func:`reset_peak_rss`.

    Read by hand: psutil has no peak RSS on Linux (only Windows' ``peak_wset``), and only the
    kernel's ``VmHWM`` can be reset between phases; elsewhere ``getrusage``'s lifetime peak.
    """
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """Resident memory of this process now (psutil: ``VmRSS`` on Linux, the task info on macOS)."""
    return int(psutil.Process().memory_info().rss)


def reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark to the current RSS (Linux); False if not.

    By hand: writing 5 to ``/proc/self/clear_refs`` is the kernel's only interface for this, and
    psutil (which reads process memory, never resets it) has no equivalent.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def cuda_peak_bytes() -> int | None:
    """``torch.cuda.max_memory_allocated()`` of the current device, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated())
