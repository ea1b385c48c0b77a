"""The one compressor interface (Horovod's shape) and the wrappers every method shares.

A :class:`Compressor` turns a flat gradient bucket into a *payload* (a list of tensors to send)
plus a *context* (what the receiver needs to decode it and what never travels), and back:
``compress(tensor, key=...) -> (payload, ctx)`` and ``decompress(payload, ctx) -> tensor``. How the
payloads of all ranks are combined depends on the method and is declared, not assumed:

* ``summable = True``: the sum of the payloads of all ranks decodes to the sum of their
  gradients (fp16, bf16, RandomK with a shared index draw), so they are all-reduced;
* otherwise the payloads are all-gathered and each rank's payload is decoded and summed
  (int8 with a per-rank scale, TopK, threshold, sign, ternary) - nothing that cannot be summed
  is all-reduced.

Methods that need several rounds (PowerSGD, EF21) override :meth:`Compressor.reduce`.
Everything with state (error-feedback residuals, warm-start factors, random streams) is in
``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Compressor",
    "Comm",
    "ErrorFeedback",
    "Identity",
    "Payload",
    "Timer",
    "payload_bytes",
]

Payload = list[torch.Tensor]


def payload_bytes(payload: Payload) -> int:
    """Bytes the payload occupies on the wire."""
    return sum(t.numel() * t.element_size() for t in payload)


@dataclass(slots=True)
class Comm:
    """The collectives a compressor may use, with byte and time accounting.

    Bytes are counted per rank as the ring algorithms send them: an all-reduce of ``n`` bytes
    sends ``2 (w - 1) / w * n``, an all-gather of ``n`` bytes per rank sends ``(w - 1) n``.
    The uncompressed reference is an all-reduce of the fp32 bucket, so for any world size the
    ratio compares what the links actually carry.

    Args:
        group: Process group (``None`` = default group; a world of one needs no group).
        allreduce_fn: Optional replacement for the summing all-reduce (e.g. the comm layer's
            algorithm); called as ``allreduce_fn(tensor, group)`` and must sum in place.
    """

    group: dist.ProcessGroup | None = None
    allreduce_fn: Callable[[torch.Tensor, Any], None] | None = None
    bytes_sent: int = 0
    comm_s: float = 0.0
    rounds: int = 0
    _size: int = field(default=0, repr=False)

    @property
    def world_size(self) -> int:
        if not self._size:
            self._size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        return self._size

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take tensors: the current CUDA device under NCCL,
        else the CPU (small control tensors, such as a broadcast decision, are made here)."""
        if dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_sum(self, tensors: Payload) -> Payload:
        """Sum ``tensors`` over ranks in place (one flat message per dtype)."""
        w = self.world_size
        t0 = time.perf_counter()
        self.rounds += 1
        for t in tensors:
            self.bytes_sent += int(2 * (w - 1) / w * t.numel() * t.element_size()) if w > 1 else 0
            if w > 1:
                if self.allreduce_fn is not None:
                    self.allreduce_fn(t, self.group)
                else:
                    dist.all_reduce(t, group=self.group)
        self.comm_s += time.perf_counter() - t0
        return tensors

    def all_gather(self, payload: Payload) -> list[Payload]:
        """Every rank's payload (same shapes on every rank), in rank order."""
        w = self.world_size
        if w == 1:
            return [payload]
        t0 = time.perf_counter()
        self.rounds += 1
        gathered: list[Payload] = [[] for _ in range(w)]
        for t in payload:
            parts = [torch.empty_like(t) for _ in range(w)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            self.bytes_sent += (w - 1) * t.numel() * t.element_size()
            for r in range(w):
                gathered[r].append(parts[r])
        self.comm_s += time.perf_counter() - t0
        return gathered

    def barrier(self) -> None:
        """Meet every rank of the group (not counted: it carries no payload)."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast from ``src`` (used for decisions that must agree on every rank)."""
        if self.world_size > 1:
            self.rounds += 1
            self.bytes_sent += tensor.numel() * tensor.element_size()
            dist.broadcast(
                tensor,
                src=dist.get_global_rank(self.group, src) if self.group else src,
                group=self.group,
            )
        return tensor


class Compressor(ABC):
    """A gradient compressor; see the module docstring for the contract.

    Attributes:
        name: The spec string this compressor was built from (``topk:0.01``).
        summable: Payloads may be summed by an all-reduce (see module docstring).
    """

    name: str = "?"
    summable: bool = False

    @abstractmethod
    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        """Encode a flat fp32 tensor; ``key`` names the bucket for per-bucket state."""

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Decode a payload (this rank's, another rank's, or a sum of summable payloads)."""

    def combine(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        """Mean of the decoded gradients of all ranks (majority vote overrides this)."""
        out = decoded[0].clone()
        for d in decoded[1:]:
            out += d
        return out.div_(len(decoded))

    def reduce(
        self,
        tensor: torch.Tensor,
        comm: Comm,
        *,
        key: int = 0,
        timer: Timer | None = None,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.Tensor:
        """Mean over ranks of ``tensor`` as this method transmits it: compress, then exchange.

        Args:
            tensor: This rank's flat bucket.
            comm: Collectives and accounting.
            key: Bucket id (per-bucket state).
            timer: Accumulates compress/decompress seconds.
            shapes: Shapes of the parameters packed in the bucket, in order (PowerSGD uses them;
                the rest ignore them).
        """
        timer = timer or Timer()
        with timer.compress:
            payload, ctx = self.compress(tensor, key=key)
        return self.exchange(payload, ctx, comm, timer)

    def exchange(self, payload: Payload, ctx: Any, comm: Comm, timer: Timer) -> torch.Tensor:
        """Send this rank's payload and return the mean of all ranks' decoded gradients."""
        if self.summable:
            comm.all_reduce_sum(payload)
            with timer.decompress:
                return self.decompress(payload, ctx).div_(comm.world_size)
        gathered = comm.all_gather(payload)
        with timer.decompress:
            return self.combine([self.decompress(p, ctx) for p in gathered])

    def unsent(self, tensor: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        """``tensor - decompress(payload, ctx)``: what compression dropped (error feedback's
        residual). May reuse ``tensor``'s memory; sparse methods subtract in place."""
        return tensor - self.decompress(payload, ctx)

    def take_residual(self, key: int) -> torch.Tensor | None:
        """Remove and return the error-feedback residual of bucket ``key`` (None if there is none).

        The adaptive mode adds it to the next gradient of that bucket when it switches method,
        so no accumulated error is dropped.
        """
        return None

    def reset_errors(self) -> None:
        """Drop the accumulated error state (residuals, factors, estimates) of every bucket.

        Called on every rank after an exchange came out non-finite (an fp16 overflow that the
        loss scaler will skip): that step's gradient must not stay in the state, or every later
        step would carry the inf/NaN. Random-stream counters are kept (ranks stay in step).
        """
        return None  # stateless methods have nothing to drop

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} has no state, got keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class _Span:
    __slots__ = ("seconds", "_t0")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._t0


class Timer:
    """Compress and decompress seconds of one exchange."""

    __slots__ = ("compress", "decompress")

    def __init__(self) -> None:
        self.compress = _Span()
        self.decompress = _Span()


class Identity(Compressor):
    """No compression: the fp32 bucket is all-reduced as DDP would."""

    name = "none"
    summable = True

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        return [tensor], None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0]


class ErrorFeedback(Compressor):
    """Residual accumulation around any compressor (Seide et al. 2014; Karimireddy et al. 2019).

    Per bucket: ``corrected = grad + residual``; send ``C(corrected)``;
    ``residual = corrected - decode(C(corrected))``. What was not sent is sent later, which makes
    biased compressors (TopK, sign) converge like uncompressed SGD.

    Args:
        inner: The lossy compressor.
    """

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.name = inner.name
        self.summable = inner.summable
        self.residuals: dict[int, torch.Tensor] = {}

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        residual = self.residuals.get(key)
        if residual is not None and residual.shape != tensor.shape:
            residual = None  # the bucket was rebuilt (DDP's first-iteration rebucketing)
        corrected = tensor + residual if residual is not None else tensor.clone()
        payload, ctx = self.inner.compress(corrected, key=key)
        self.residuals[key] = self.inner.unsent(corrected, payload, ctx)
        return payload, ctx

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def combine(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        return self.inner.combine(decoded)

    def exchange(self, payload: Payload, ctx: Any, comm: Comm, timer: Timer) -> torch.Tensor:
        return self.inner.exchange(payload, ctx, comm, timer)

    def take_residual(self, key: int) -> torch.Tensor | None:
        return self.residuals.pop(key, None)

    def reset_errors(self) -> None:
        self.residuals.clear()
        self.inner.reset_errors()

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {str(k): v.clone() for k, v in self.residuals.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {int(k): v.clone() for k, v in state.get("residuals", {}).items()}
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"
