"""Mixed precision for every ZeRO stage, and gradient (loss) scaling for fp16.

=====  ==========================================================  ==========================
stage  16-bit compute                                              gradient reduction
=====  ==========================================================  ==========================
0-1    ``torch.autocast(dtype)`` around the model's forward         fp32 (DDP reduces ``.grad``)
2-3    FSDP2 ``MixedPrecisionPolicy(param_dtype)`` (:mod:`.sharded`)  ``reduce_dtype``
=====  ==========================================================  ==========================

Under FSDP2 the whole forward/backward runs in ``param_dtype`` on copies gathered from the fp32
shards (the master weights); under autocast only the ops on torch's autocast lists run in 16
bits (matmuls, attention), the rest (norms, the loss) in fp32, and the fp32 parameters are
cast per forward.

fp16 has 5 exponent bits: small gradients underflow to zero and large ones overflow. Whenever
fp16 is used (``param_dtype`` or ``reduce_dtype``), :class:`LossScaler` multiplies the loss
by a scale before backward, divides the gradients by it before clipping and the optimizer step,
and skips the step when any gradient is inf/NaN, halving the scale (it doubles after
``growth_interval`` clean steps). Every rank must skip the same steps: under FSDP2 each rank
only sees its gradient shards, and if one rank stepped while another skipped, the shards (and
optimizer states) would silently diverge. In torch 2.13 two mechanisms ensure agreement, and we
rely on both: DTensor's handler for the fused unscale op (``found_inf_reduce_handler``)
max-reduces the inf flag over the mesh of sharded gradients, and torch's ``ShardedGradScaler``
(``torch.amp.GradScaler`` plus an all-reduce of that one-element flag over the world), which we
use at every stage, also covers gradients that are not DTensors (DDP's, already identical
after the all-reduce; parameters FSDP does not manage). bf16 has fp32's exponent range and
needs no scaling.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from torsh_distributed.parallel.config import ParallelConfig

__all__ = ["apply_autocast", "needs_grad_scaling", "LossScaler"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# ShardedGradScaler's found-inf flag (shape (1,)) meets DTensor gradients in the fused unscale;
# DTensor replicates it implicitly and warns every step. The replication is what we want.
_DTENSOR_SCALAR_WARNING = "Found a non-scalar tensor with numel=1"


def needs_grad_scaling(config: ParallelConfig) -> bool:
    """True when fp16 is used anywhere (compute or gradient reduction)."""
    return "fp16" in (config.param_dtype, config.reduce_dtype)


def apply_autocast(module: nn.Module, *, dtype: str, device_type: str) -> nn.Module:
    """Run ``module``'s forward under ``torch.autocast(device_type, dtype)``; in place.

    The instance's ``forward`` is replaced by the autocast-decorated one (as Hugging Face
    Accelerate does), so parameter names, state dicts and a DDP wrapper applied afterwards are
    unchanged; non-reentrant activation checkpointing records and restores the autocast state
    when it recomputes. Backward runs in the dtypes autocast chose in forward.

    Args:
        module: The model (before DDP wraps it).
        dtype: ``bf16`` or ``fp16``.
        device_type: ``cpu`` or ``cuda`` (torch supports both dtypes on both in 2.13).

    Raises:
        ValueError: another dtype.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"autocast dtype must be bf16 or fp16, got {dtype!r}")
    module.forward = torch.autocast(device_type, dtype=_DTYPES[dtype])(module.forward)  # type: ignore[method-assign]
    return module


class LossScaler:
    """Dynamic loss scaling for fp16 (torch's ``ShardedGradScaler``), or a no-op.

    Call, per step: :meth:`backward` instead of ``loss.backward()``, :meth:`unscale` before
    gradient clipping (so the clip threshold applies to true gradients), and :meth:`step`
    instead of ``optimizer.step()``. Disabled, each is the plain operation, so a loop can
    construct one unconditionally with ``enabled=(dtype == "fp16")``::

        scaler = LossScaler(enabled=True, device=device)
        for x, y in batches:
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.backward(loss)
            scaler.unscale(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)  # False when skipped: the same steps on every rank

    With a process group initialised at construction, the inf/NaN flag is all-reduced over
    ``process_group`` (torch's ``ShardedGradScaler``), so every rank skips the same steps, which
    sharded gradients (FSDP2) need; without one it is torch's plain ``GradScaler``.

    Args:
        enabled: Scale at all. Only fp16 needs it (5 exponent bits); bf16 and fp32 have fp32's
            range, and scaling them only costs a multiply and an inf check per step.
        device: This rank's device; its type picks torch's CPU or CUDA kernels.
        init_scale: Initial scale, a finite number > 0. Larger keeps more small gradients from
            underflowing but overflows (skips) more first steps; the default ``2**15`` is the
            largest power of two fp16 holds (torch's ``2**16`` is inf in fp16, so an fp16 loss,
            as under FSDP2, would always skip the first step).
        growth_interval: Double the scale after this many steps without overflow (>= 1).
            Shorter recovers range sooner after a backoff but overflows, and skips, more often.
        process_group: Ranks that must agree on skipping; ``None`` = the world (every rank
            that steps an optimizer must be in it). Unused without a process group.

    Raises:
        ValueError: ``init_scale`` not a finite number > 0, or ``growth_interval`` < 1.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        device: torch.device | str,
        init_scale: float = 2.0**15,
        growth_interval: int = 2000,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        device = torch.device(device)
        self.enabled = bool(enabled)
        if dist.is_initialized():
            self._scaler: torch.amp.GradScaler = ShardedGradScaler(
                device.type,
                init_scale=init_scale,
                growth_interval=growth_interval,
                enabled=self.enabled,
                process_group=process_group,
            )
        else:  # without a process group there is nobody to agree with: torch's plain GradScaler
            self._scaler = torch.amp.GradScaler(
                device.type,
                init_scale=init_scale,
                growth_interval=growth_interval,
                enabled=self.enabled,
            )
        self._precision: dict[str, Any] = {}
        self.skipped_steps = 0
        """Optimizer steps skipped because a gradient overflowed (the same on every rank)."""
        self.skipped_at: list[int] = []
        """1-based numbers, counted from this run's first step, of the skipped steps (first 100)."""
        self._steps = 0

    @classmethod
    def from_config(cls, config: ParallelConfig, *, device: torch.device | str) -> LossScaler:
        """The scaler the engine uses for a ``parallel`` section: enabled whenever fp16 is used
        (:func:`needs_grad_scaling`), with ``loss_scale_init`` and ``loss_scale_growth_interval``;
        its :meth:`summary` then also describes the section's dtypes.

        Args:
            config: The ``parallel`` section (already validated by its constructor).
            device: This rank's device.
        """
        scaler = cls(
            enabled=needs_grad_scaling(config),
            device=device,
            init_scale=config.loss_scale_init,
            growth_interval=config.loss_scale_growth_interval,
        )
        if (config.param_dtype, config.reduce_dtype) != ("fp32", "fp32"):
            compute = "autocast" if config.zero_stage <= 1 else "fsdp2"
            scaler._precision = {
                "param_dtype": config.param_dtype,
                "reduce_dtype": config.reduce_dtype,
                "compute": compute if config.param_dtype != "fp32" else "fp32",
            }
        return scaler

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * scale).backward()``; plain ``loss.backward()`` when disabled."""
        if self.enabled:
            self._scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale and agree across ranks whether any is inf/NaN."""
        if self.enabled:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_DTENSOR_SCALAR_WARNING)
                self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` unless a gradient overflowed, then update the scale.

        Returns:
            Whether the optimizer stepped. A skip backs the scale off; since the inf flag is
            all-reduced, every rank skips the same steps.
        """
        self._steps += 1
        if not self.enabled:
            optimizer.step()
            return True
        before = self._scaler.get_scale()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DTENSOR_SCALAR_WARNING)
            self._scaler.step(optimizer)
        self._scaler.update()
        # the scale only ever shrinks on an overflow (backoff_factor < 1)
        stepped = self._scaler.get_scale() >= before
        if not stepped:
            self.skipped_steps += 1
            if len(self.skipped_at) < 100:
                self.skipped_at.append(self._steps)
        return stepped

    @property
    def scale(self) -> float:
        """The current loss scale (1.0 when disabled)."""
        return float(self._scaler.get_scale()) if self.enabled else 1.0

    def state_dict(self) -> dict[str, Any]:
        """torch's scaler state (scale, growth tracker); empty when disabled."""
        return self._scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._scaler.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        """The ``precision`` block of a run summary.

        ``{}`` for a disabled scaler built directly, or by :meth:`from_config` for an all-fp32
        run; otherwise ``loss_scaling`` and, when enabled, ``loss_scale``, ``skipped_steps`` and
        ``skipped_at``, preceded by the section's dtypes when built by :meth:`from_config`.
        """
        if not self.enabled and not self._precision:
            return {}
        out: dict[str, Any] = {**self._precision, "loss_scaling": self.enabled}
        if self.enabled:
            out["loss_scale"] = self.scale
            out["skipped_steps"] = self.skipped_steps
            out["skipped_at"] = list(self.skipped_at)
        return out
