"""Horovod's ``Compression`` (``none``, ``fp16``) and an adapter for our compressors.

Horovod's compressors turn one tensor into one tensor that is all-reduced and turned back::

    compressed, ctx = compression.compress(tensor)   # all-reduced by Horovod
    tensor = compression.decompress(compressed, ctx)

Our :class:`~torsh_distributed.compression.base.Compressor` methods need more than a sum (TopK and
int8 all-gather their payloads, PowerSGD runs two rounds, error feedback keeps residuals), so
``Compression.torsh("topk:0.01")`` returns a :class:`TorshCompression` that
:func:`DistributedOptimizer` and :func:`allreduce` recognise and hand the whole exchange to
(``Compressor.reduce``), one tensor at a time.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.compat.horovod._basics import Op
from torsh_distributed.compression.base import Comm, Compressor

__all__ = [
    "Compression",
    "FP16Compressor",
    "HorovodCompressor",
    "NoneCompressor",
    "TorshCompression",
]


class HorovodCompressor:
    """Horovod's compressor interface: ``compress(tensor) -> (tensor, ctx)`` and back."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to all-reduce and what :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The reduced tensor in its original form."""
        raise NotImplementedError


class NoneCompressor(HorovodCompressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(HorovodCompressor):
    """Send floating-point tensors as fp16 (halves the bytes; sums in fp16, as in Horovod)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compressed = tensor
        if tensor.dtype.is_floating_point:
            compressed = tensor.type(torch.float16)
        return compressed, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx.is_floating_point:
            return tensor.type(ctx)
        return tensor


class TorshCompression:
    """One of our compressors behind Horovod's ``compression=`` argument.

    The exchange is the compressor's own (``Compressor.reduce``: all-reduce for summable
    payloads, all-gather otherwise, several rounds for PowerSGD) and is blocking: the optimizer
    runs it when a gradient is ready, in the fixed parameter order, instead of overlapping it
    with the rest of backward. Each tensor keeps its own error-feedback residual under a key
    (the parameter's index in the optimizer; for :func:`allreduce`, a checksum of ``name=``).

    Args:
        compressor: A built :class:`~torsh_distributed.compression.base.Compressor`.
    """

    def __init__(self, compressor: Compressor) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(
                f"TorshCompression wraps a torsh_distributed Compressor, got {type(compressor).__name__}"
            )
        if hasattr(compressor, "step_end"):
            raise ValueError(
                "compression 'auto' decides once per step from the DDP hook's statistics and is "
                "not available through the Horovod API; choose a fixed method (e.g. 'topk:0.01')"
            )
        self.compressor = compressor

    @property
    def name(self) -> str:
        """The compressor's spec (``topk:0.01``)."""
        return str(self.compressor.name)

    def reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: Op,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        key: int = 0,
    ) -> torch.Tensor:
        """Average (or sum) ``tensor`` over the ranks as the compressor transmits it.

        Returns a new tensor of ``tensor``'s shape and dtype; ``tensor`` is not modified.

        Raises:
            ValueError: ``op`` is neither Average nor Sum (the compressors compute a mean).
        """
        if op not in (Op.AVERAGE, Op.SUM):
            raise ValueError(
                f"compression {self.name!r} computes a mean; op must be hvd.Average or hvd.Sum, "
                f"got hvd.{op.name.title()}"
            )
        flat = tensor.detach().reshape(-1).to(torch.float32, copy=True)
        if prescale_factor != 1.0:
            flat.mul_(prescale_factor)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            out = self.compressor.reduce(flat, Comm(), key=key, shapes=[tensor.shape])
        else:
            out = flat
        if op is Op.SUM:
            out = out * world
        if postscale_factor != 1.0:
            out = out * postscale_factor
        return out.reshape(tensor.shape).to(tensor.dtype)

    @staticmethod
    def key_for(name: str | None) -> int:
        """The state key of a named :func:`allreduce` call (0 without a name)."""
        return zlib.crc32(name.encode()) if name else 0

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise TypeError(
            f"compression {self.name!r} exchanges through its own protocol, not one all-reduce; "
            "pass it to hvd.DistributedOptimizer(compression=...) or hvd.allreduce(compression=...)"
        )

    decompress = compress

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state (error-feedback residuals, PowerSGD factors, random streams)."""
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.compressor.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Compression.torsh({self.compressor!r})"


def torsh_compression(
    spec: str | Compressor,
    *,
    error_feedback: bool | None = None,
    seed: int = 0,
) -> TorshCompression:
    """``Compression.torsh(spec)``: one of our compressors for Horovod's ``compression=``.

    Args:
        spec: A spec string (``"topk:0.01"``, ``"powersgd:4"``, ``"int8"``, ``"ef21:sign"``, ...;
            see docs/compression.md) or a built Compressor. ``"auto"`` is refused.
        error_feedback: ``None`` = the method's default; ``True``/``False`` forces it.
        seed: Seed of random choices (RandomK, stochastic rounding); equal on every rank.

    Raises:
        ValueError: invalid spec, or ``auto``.
    """
    if isinstance(spec, Compressor):
        if error_feedback is not None:
            raise ValueError("error_feedback applies to a spec string, not a built compressor")
        return TorshCompression(spec)
    from torsh_distributed.compression.spec import build_fixed, parse_spec

    parsed = parse_spec(spec)
    if parsed.kind == "auto":
        raise ValueError(
            "compression 'auto' is not available through the Horovod API; choose a fixed "
            "method (e.g. 'topk:0.01')"
        )
    return TorshCompression(build_fixed(parsed, error_feedback=error_feedback, seed=seed))


class Compression:
    """Horovod's namespace of compressors, plus ``torsh(spec)`` for ours."""

    none = NoneCompressor
    """Do not compress (the default)."""
    fp16 = FP16Compressor
    """Send floating-point tensors as fp16."""
    torsh = staticmethod(torsh_compression)
    """``Compression.torsh("topk:0.01")``: any fixed method of torsh_distributed.compression."""
