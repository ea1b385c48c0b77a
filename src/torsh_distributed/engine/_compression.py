"""The engine's gradient compression: attach to the model, exchange, summarise.

``GradCompression(section, zero_stage=..., algorithm=..., seed=...)`` validates the combination
(any method on DDP's exchange at ZeRO stage 0; at stages 2-3 ``int8`` only, as block-quantised
FSDP2 all-gather and reduce-scatter, ZeRO++'s qwZ/qgZ, installed by ``attach``).
``attach(model, base)`` registers the compression hook on a DDP model; the engine then makes
DDP re-bucket before the first step (:func:`~torsh_distributed.compression.hooks.prime_buckets`,
its forward not counted: :meth:`GradCompression.uncounted`), so compressor state never meets a
second bucket layout, in a run or after a resume. Without DDP (tensor parallelism, pipeline
stages) ``attach_flat(group)`` builds the same hook state for the engine's one flat
data-parallel exchange of the local gradient shards, which ``reduce_flat`` runs (accounting,
warm-up, error state, checkpoints and the summary as with DDP). ``observe_loss`` feeds ``auto``
the training loss once per step. ``summary()`` is the ``"compression"`` entry of the run summary;
``stateful`` is the object whose ``state_dict()`` a checkpoint must save (residuals, PowerSGD
factors, auto's decisions). With ``comm.algorithm`` the compression hook (DDP takes one) sums its
summable payloads through the facade with that algorithm.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.compression.base import Compressor
from torsh_distributed.compression.build import build_compressor
from torsh_distributed.compression.config import CompressionConfig
from torsh_distributed.compression.hooks import CompressionHook, register_compression
from torsh_distributed.compression.spec import parse_spec
from torsh_distributed.engine._comm import world_or_group
from torsh_distributed.engine._plan import _ZERO_MP, check_compression
from torsh_distributed.parallel.sharded import QuantStats, quantize_collectives

__all__ = ["GradCompression", "check_compression"]


class GradCompression:
    """See the module docstring.

    Args:
        section: The ``compression`` section.
        zero_stage: ZeRO stage of the run (0: any method; 2-3: ``int8`` collectives).
        algorithm: ``comm.algorithm`` (the facade algorithm compressed sums go through; ``""``).
        seed: Seed of the randomised methods (randomk, stochastic rounding).
    """

    def __init__(
        self, section: CompressionConfig, *, zero_stage: int, algorithm: str = "", seed: int = 0
    ) -> None:
        check_compression(section, zero_stage=zero_stage)
        self.section = section
        self.zero_stage = zero_stage
        self.quantized: QuantStats | None = None
        """Bytes of the int8 FSDP2 collectives (zero_stage 2-3), when installed."""
        if section.enabled and zero_stage >= 2:
            for name, value, default in (
                ("--compression-warmup", section.warmup_steps, 0),
                ("--error-feedback", section.error_feedback, "default"),
                ("--stochastic-rounding", section.stochastic_rounding, False),
            ):
                if value != default:
                    warnings.warn(
                        f"{name} is ignored with --zero-stage {zero_stage} --compression int8: "
                        "the quantised collectives round to nearest from the first step and keep "
                        "no error state",
                        stacklevel=2,
                    )
        self.algorithm = algorithm
        self.seed = seed
        self.hook: CompressionHook | None = None
        self._dense_bytes = 0
        self._dense_steps = 0
        self._handles: list[Any] = []
        self._counting = True

    def attach(self, model: nn.Module, base: nn.Module) -> None:
        """Register the compression hook on ``model`` (the DDP wrapper of ``base``); the caller
        then primes DDP's buckets when :attr:`hook` is set (its state is per bucket)."""
        if not self.section.enabled:
            if isinstance(model, nn.parallel.DistributedDataParallel):
                self._count_dense_steps(model, base)
            return
        if self.zero_stage >= 2:
            self.quantized = quantize_collectives(base)
            return
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            warnings.warn(
                f"--compression {self.section.method} is ignored: the model is not wrapped in DDP "
                "(a single rank has no gradients to exchange)",
                stacklevel=2,
            )
            return
        compressor = self._compressor()
        self.hook = register_compression(
            model,
            compressor,
            warmup_steps=self.section.warmup_steps,
            allreduce_fn=_facade_sum(self.algorithm, model.process_group),
        )

    def attach_flat(
        self, group: dist.ProcessGroup | None, *, positions: dict[int, int] | None = None
    ) -> None:
        """Without DDP: compress the engine's flat gradient exchange over the data-parallel
        ``group`` (see :meth:`reduce_flat`). A no-op for ``none``; ``group=None`` (dp 1: no
        exchange) warns that compression is ignored.

        Args:
            positions: ``id(parameter) -> index`` in the whole model's parameter order; the hook
                records which parameters its state belongs to and resets state saved for others
                (a resume with another pipeline split or schedule), as with DDP's buckets.
        """
        if not self.section.enabled:
            return
        if self.zero_stage >= 2:
            raise ValueError(_ZERO_MP)
        if group is None:
            warnings.warn(
                f"--compression {self.section.method} is ignored with dp 1: there is no "
                "data-parallel gradient exchange to compress",
                stacklevel=2,
            )
            return
        compressor = self._compressor()
        self.hook = CompressionHook(
            compressor, group=group, warmup_steps=self.section.warmup_steps, positions=positions
        )

    def reduce_flat(self, flat: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
        """The mean over the data-parallel group of ``flat`` (the local gradient shards of
        ``params``, concatenated), as the method transmits it."""
        if self.hook is None:
            raise RuntimeError("reduce_flat needs attach_flat() with a compression method")
        return self.hook.run(_FlatBucket(flat, params)).wait()

    def observe_loss(self, loss: float) -> None:
        """Feed a training loss to ``auto``'s instability back-off (a no-op for fixed methods)."""
        observe = getattr(self.hook.compressor, "observe_loss", None) if self.hook else None
        if observe is not None:
            observe(loss)

    def _compressor(self) -> Compressor:
        s = self.section
        return build_compressor(
            s.method,
            error_feedback=s.ef,
            stochastic_rounding=s.stochastic_rounding,
            seed=self.seed,
        )

    def _count_dense_steps(self, model: nn.Module, base: nn.Module) -> None:
        """``none`` installs no hook (DDP's own all-reduce); count training forwards instead."""
        world = model.process_group.size()
        numel = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
        self._dense_bytes = int(2 * (world - 1) / world * numel)

        # A weak reference: the hook lives on ``base``, which the DDP wrapper holds; a strong one
        # made a cycle that kept DDP (and its process group) alive until the interpreter's final
        # garbage collection, where destroying Gloo's state aborted the process now and then.
        wrapper = weakref.ref(model)

        def _count(module: nn.Module, args: Any, output: Any) -> None:
            # one exchange per step: forwards under no_sync (--grad-accum) send nothing
            ddp = wrapper()
            if (
                self._counting
                and module.training
                and torch.is_grad_enabled()
                and getattr(ddp, "require_backward_grad_sync", True)
            ):
                self._dense_steps += 1

        self._handles.append(base.register_forward_hook(_count))

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Forwards inside are not training steps (DDP's bucket priming): not counted."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True

    def close(self) -> None:
        """Remove the hooks this object put on the user's model (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def stateful(self) -> CompressionHook | None:
        """The ``Stateful`` to checkpoint (``None`` when nothing is compressed)."""
        return self.hook

    def summary(self) -> dict[str, Any]:
        """``{"method", "bytes_uncompressed", "bytes_sent", "ratio", "seconds", ...}`` of this rank."""
        if self.quantized is not None:  # int8 FSDP2 collectives (ZeRO-2/3)
            return {
                "method": "int8",
                "collectives": "fsdp2 all-gather + reduce-scatter (block-quantised)",
                **self.quantized.as_dict(),
            }
        if self.hook is None:  # none: DDP's fp32 all-reduce, bytes from the parameter count
            dense = self._dense_bytes * self._dense_steps
            return {
                "method": str(parse_spec(self.section.method)),
                "bytes_uncompressed": dense,
                "bytes_sent": dense,
                "ratio": 1.0,
                "seconds": 0.0,
                "steps": self._dense_steps,
            }
        out = self.hook.summary()
        decisions = getattr(self.hook.compressor, "decisions", None)
        if decisions:
            out["decisions"] = list(decisions)
        return out


class _FlatBucket:
    """A :class:`~torsh_distributed.compression.hooks.Bucket` of one flat tensor (no DDP)."""

    def __init__(self, flat: torch.Tensor, params: list[nn.Parameter]) -> None:
        self._flat, self._params = flat, params

    def buffer(self) -> torch.Tensor:
        return self._flat

    def index(self) -> int:
        return 0

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)  # layout (ids) and, through their local shards, PowerSGD's shapes

    def is_last(self) -> bool:
        return True


def _facade_sum(algorithm: str, group: Any) -> Callable[[torch.Tensor, Any], None] | None:
    """``--comm.algorithm`` with compression: the compression hook (DDP's one comm hook) sums
    its summable payloads (fp16, bf16, PowerSGD factors, warm-up buckets) through the facade with
    that algorithm; gathered payloads (sparse, sign, int8) use all_gather as before."""
    if not algorithm:
        return None
    from torsh_distributed.comm import collectives as C

    target = world_or_group(group)  # the hook's group (DDP's), resolved once

    def allreduce(tensor: torch.Tensor, _group: Any) -> None:
        C.all_reduce(tensor, group=target, algorithm=algorithm)

    return allreduce
