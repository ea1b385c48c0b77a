"""Adapters: any :class:`~torsh_distributed.compression.base.Compressor` as a DDP comm hook,
with honest per-step accounting.

``register_compression(ddp_model, compressor)`` (a compressor or a spec string such as
``"powersgd:4"``) registers :func:`compression_hook` with a :class:`CompressionHook` as its
state, in any training loop; on one process it registers nothing and returns ``None``. DDP
calls the hook once per gradient bucket; the hook returns the mean over ranks of the bucket *as
the method transmits it*. ``none`` keeps DDP's asynchronous all-reduce (overlapped with the rest
of backward); every other method exchanges its payload synchronously inside the hook (its
compression runs on the same cores as backward anyway on CPU; on slow links the bytes saved
dominate).

Accounting, per step and in total: ``bytes_uncompressed`` (what this rank's links would carry
for DDP's fp32 ring all-reduce of the same buckets: ``2 (w - 1) / w`` times the bucket bytes),
``bytes_sent`` (what the method's collectives carry, counted the same way, padding and extra
rounds included), compress/decompress seconds and communication seconds.

Bucket layout: compressor state is kept per bucket (a residual is a flat tensor laid out like its
bucket), and DDP re-buckets once, after the first iteration, in the order gradients became ready.
The hook records which parameters each bucket holds; state saved under another layout is never
applied to it (it is reset, with a warning). :func:`prime_buckets` makes DDP re-bucket before the
first real step, so a run and its resumed continuation see one layout throughout.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.compression.base import Comm, Compressor, Identity, Timer
from torsh_distributed.compression.build import build_compressor
from torsh_distributed.compression.spec import parse_spec

__all__ = [
    "Bucket",
    "CompressionHook",
    "StepStats",
    "compression_hook",
    "register_compression",
    "find_compression",
    "prime_buckets",
]

log = logging.getLogger(__name__)


class Bucket(Protocol):
    """What :meth:`CompressionHook.run` reads of a gradient bucket: DDP's ``dist.GradBucket``,
    or the flat dp exchange of a model-parallel run (``sync_grads``)."""

    def buffer(self) -> torch.Tensor: ...

    def index(self) -> int: ...

    def parameters(self) -> list[torch.Tensor]: ...

    def is_last(self) -> bool: ...

_ATTR = "_torsh_compression"


@dataclass(slots=True)
class StepStats:
    """Accounting of one step (or, summed, of a run) on this rank."""

    bytes_uncompressed: int = 0
    bytes_sent: int = 0
    compress_s: float = 0.0
    decompress_s: float = 0.0
    comm_s: float = 0.0
    buckets: int = 0

    @property
    def ratio(self) -> float:
        """``bytes_uncompressed / bytes_sent`` (1.0 when nothing was sent)."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0

    def add(self, other: StepStats) -> None:
        for name in (
            "bytes_uncompressed",
            "bytes_sent",
            "compress_s",
            "decompress_s",
            "comm_s",
            "buckets",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


class CompressionHook:
    """State of :func:`compression_hook`: the compressor, the accounting, the step counter.

    A torch ``Stateful``: ``state_dict()`` holds the compressor's state (residuals, PowerSGD
    factors, random-stream counters) and the totals, so a restored run continues identically.

    Args:
        compressor: What to apply to every bucket.
        group: Data-parallel process group (``None`` = default).
        allreduce_fn: Optional summing all-reduce replacing ``dist.all_reduce`` for summable
            payloads (``fn(tensor, group)``, in place), e.g. an algorithm of the comm layer.
        on_step: Called with the :class:`StepStats` of every finished step (monitoring).
        positions: ``id(parameter) -> index`` in the model's parameter order; lets the hook
            record each bucket's layout (set by :func:`register_compression`).
        warmup_steps: Exchange uncompressed (exact mean) gradients for the first this many
            steps, counted as sent in full; the compressor starts after them with empty state
            (torch's ``start_powerSGD_iter``; DGC's warm-up). Early gradients change fastest,
            and a low-rank or sparse start makes the first steps' error largest.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        group: dist.ProcessGroup | None = None,
        allreduce_fn: Callable[[torch.Tensor, Any], None] | None = None,
        on_step: Callable[[StepStats], None] | None = None,
        positions: dict[int, int] | None = None,
        warmup_steps: int = 0,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.compressor = compressor
        self.warmup_steps = warmup_steps
        self._dense = Identity()
        self.group = group
        self.allreduce_fn = allreduce_fn
        self.on_step = on_step
        self.steps = 0
        self.current = StepStats()
        self.last_step = StepStats()
        self.total = StepStats()
        self._world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.positions = positions or {}
        self.layouts: dict[int, tuple[int, ...]] = {}
        """Bucket index -> indices of the parameters it holds, in bucket order."""
        self.passthrough = False
        """Plain all-reduce, no state and no accounting (set by :func:`prime_buckets`)."""
        self._fresh = copy.deepcopy(compressor.state_dict())
        self._nonfinite = False
        self.error_resets = 0
        """Steps whose exchange came out non-finite, after which the error state was dropped."""

    @property
    def method(self) -> str:
        return self.compressor.name

    def observe_loss(self, loss: float) -> None:
        """Feed this step's training loss to a compressor that adapts to it; else a no-op.

        ``auto`` (:class:`~torsh_distributed.compression.adaptive.Adaptive`) backs off to lighter
        compression when the loss turns unstable, and sees the loss only through this call: a
        loop using ``auto`` calls it once per optimizer step with the training loss (a float:
        ``loss.item()``). Only rank 0's losses are judged (rank 0 broadcasts the decision), so
        every rank may pass its own. Other methods ignore it.
        """
        observe = getattr(self.compressor, "observe_loss", None)
        if observe is not None:
            observe(float(loss))

    def _uncompressed(self, nbytes: int) -> int:
        w = self._world
        return int(2 * (w - 1) / w * nbytes) if w > 1 else 0

    def _check_layout(self, bucket: Bucket) -> None:
        """Record the bucket's layout; reset the compressor's state if it changed."""
        if not self.positions:
            return
        layout = tuple(self.positions.get(id(p), -1) for p in bucket.parameters())
        known = self.layouts.get(bucket.index())
        if known is not None and known != layout:
            warnings.warn(
                f"compression {self.method}: gradient bucket {bucket.index()} changed its "
                "parameters (DDP re-bucketing, or a resume with another pipeline split); the "
                "compressor state (residuals, factors) is reset rather than applied to other "
                "parameters. With DDP, call prime_buckets() before training to re-bucket first.",
                stacklevel=3,
            )
            self.compressor.load_state_dict(copy.deepcopy(self._fresh))
            self.layouts = {}
        self.layouts[bucket.index()] = layout

    def run(self, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if self.passthrough:
            w = self._world
            fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0].div_(w))
        self._check_layout(bucket)
        self.current.buckets += 1
        self.current.bytes_uncompressed += self._uncompressed(
            buffer.numel() * buffer.element_size()
        )
        warm = self.steps < self.warmup_steps
        compressor = self._dense if warm else self.compressor
        if isinstance(compressor, Identity) and self.allreduce_fn is None:
            # DDP's own path: asynchronous, overlapped with the rest of backward.
            self.current.bytes_sent += self._uncompressed(buffer.numel() * buffer.element_size())
            w = self._world
            fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
            result = fut.then(lambda f: f.value()[0].div_(w))
        else:
            comm = Comm(group=self.group, allreduce_fn=self.allreduce_fn)
            timer = Timer()
            shapes = [_local_shape(p) for p in bucket.parameters()]
            out = compressor.reduce(
                buffer.reshape(-1), comm, key=bucket.index(), timer=timer, shapes=shapes
            )
            self.current.bytes_sent += comm.bytes_sent
            self.current.comm_s += comm.comm_s
            self.current.compress_s += timer.compress.seconds
            self.current.decompress_s += timer.decompress.seconds
            if not warm and not bool(torch.isfinite(out).all()):
                self._nonfinite = True  # the same on every rank: out is the exchanged mean
            result = torch.futures.Future()
            result.set_result(out.view_as(buffer).to(buffer.dtype))
        if bucket.is_last():
            self._end_step()
        return result

    def _end_step(self) -> None:
        if self._nonfinite:  # an fp16 overflow: the scaler skips this step; so does the state
            self.compressor.reset_errors()
            self.error_resets += 1
            self._nonfinite = False
        step_end = getattr(self.compressor, "step_end", None)
        warm = self.steps < self.warmup_steps
        if step_end is not None and not warm:  # the adaptive mode decides here, on every rank
            step_end(Comm(group=self.group), self.current)
        self.steps += 1
        self.last_step = self.current
        self.total.add(self.current)
        self.current = StepStats()
        if self.on_step is not None:
            self.on_step(self.last_step)

    def summary(self) -> dict[str, Any]:
        """Totals of the run: method, bytes uncompressed and sent, ratio, seconds (compress +
        decompress), plus communication seconds and steps."""
        return {
            "method": self.method,
            "bytes_uncompressed": self.total.bytes_uncompressed,
            "bytes_sent": self.total.bytes_sent,
            "ratio": round(self.total.ratio, 3),
            "seconds": round(self.total.compress_s + self.total.decompress_s, 4),
            "comm_seconds": round(self.total.comm_s, 4),
            "steps": self.steps,
            "error_resets": self.error_resets,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "steps": self.steps,
            "total": asdict(self.total),
            "compressor": self.compressor.state_dict(),
            "layouts": {str(k): list(v) for k, v in self.layouts.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise ValueError(
                f"compression state was saved with method {state.get('method')!r}, "
                f"this run uses {self.method!r}"
            )
        self.steps = int(state["steps"])
        self.total = StepStats(**state["total"])
        self.compressor.load_state_dict(state["compressor"])
        self.layouts = {
            int(k): tuple(int(i) for i in v) for k, v in state.get("layouts", {}).items()
        }


def _local_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's shape on this rank (a DTensor's local shard under tensor parallelism)."""
    to_local = getattr(p, "to_local", None)
    return to_local().shape if callable(to_local) else p.shape


def compression_hook(
    state: CompressionHook, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean of the bucket over ranks, compressed by ``state``."""
    return state.run(bucket)


# torch checks the annotations of a comm hook by identity; postponed (string) annotations fail it.
compression_hook.__annotations__ = {
    "state": CompressionHook,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def register_compression(
    model: nn.Module,
    compressor: Compressor | str,
    *,
    allreduce_fn: Callable[[torch.Tensor, Any], None] | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    warmup_steps: int = 0,
) -> CompressionHook | None:
    """Compress the gradient exchange of DDP ``model``; returns the hook state, or ``None``
    where there is nothing to exchange.

    Works in any training loop: call it once after wrapping the model, before the first
    backward. DDP then calls the hook once per gradient bucket, and every rank's ``.grad`` holds
    the mean as the method transmitted it. The same script runs on one process or many::

        model = apply_ddp(model)                        # the model itself on one process
        hook = register_compression(model, "powersgd:4")  # None on one process
        for step, (x, y) in enumerate(batches):
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if hook is not None:
                hook.observe_loss(loss.item())  # only ``auto`` uses it; harmless otherwise

    Save ``hook.state_dict()`` with the checkpoint (error-feedback residuals, PowerSGD factors,
    ``auto``'s choices) and call :func:`prime_buckets` first when resuming must continue exactly.

    Args:
        model: The ``DistributedDataParallel`` model. With no process group, a world of one rank,
            or a DDP group of one rank, no gradient is exchanged and nothing is registered (the
            last warns: a DDP model in a larger world clearly expected an exchange).
        compressor: A :class:`~torsh_distributed.compression.base.Compressor`, or a spec string
            such as ``"topk:0.01"``, ``"powersgd:4"`` or ``"auto"``
            (:func:`~torsh_distributed.compression.build.build_compressor` with each method's
            default error feedback and seed 0; build it yourself for other settings). A spec is
            validated even where nothing is registered, so a typo fails on one process too.
        allreduce_fn: Optional summing all-reduce replacing ``dist.all_reduce`` for summable
            payloads (``fn(tensor, group)``, in place).
        on_step: Called with the :class:`StepStats` of every finished step (monitoring).
        warmup_steps: Exchange exact fp32 means for this many steps first (see
            :class:`CompressionHook`).

    Returns:
        The :class:`CompressionHook` (also found later by :func:`find_compression`), or ``None``
        when nothing was registered.

    Raises:
        ValueError: an invalid spec string, or a model that is not ``DistributedDataParallel``
            in a world of several ranks (FSDP/ZeRO reduce-scatter their gradients, and an
            unwrapped model exchanges none, so there is no all-reduce to compress).
        TypeError: ``compressor`` is neither a ``Compressor`` nor a string.
        RuntimeError: a communication hook is already registered (torch's error: DDP takes one).
    """
    spec = parse_spec(compressor) if isinstance(compressor, str) else None
    if spec is None and not isinstance(compressor, Compressor):
        raise TypeError(
            f"register_compression: compressor must be a Compressor or a spec string such as "
            f"'topk:0.01', got {type(compressor).__name__}"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        if world > 1:
            raise ValueError(
                f"register_compression needs a DistributedDataParallel model (wrap it with "
                f"torsh_distributed.parallel.data.apply_ddp), got {type(model).__name__} in a "
                f"world of {world} ranks: compression replaces DDP's gradient all-reduce"
            )
        log.debug("register_compression: one process, no gradient exchange to compress")
        return None
    if model.process_group.size() == 1:
        if world > 1:
            warnings.warn(
                f"register_compression: the DDP model's process group has one rank (world size "
                f"{world}); no gradient is exchanged, so nothing is compressed",
                stacklevel=2,
            )
        return None
    if spec is not None:
        compressor = build_compressor(spec)
    assert isinstance(compressor, Compressor)
    positions = {id(p): i for i, p in enumerate(model.module.parameters())}
    state = CompressionHook(
        compressor,
        group=model.process_group,
        allreduce_fn=allreduce_fn,
        on_step=on_step,
        positions=positions,
        warmup_steps=warmup_steps,
    )
    model.register_comm_hook(state, compression_hook)
    setattr(model, _ATTR, state)
    return state


def find_compression(model: nn.Module) -> CompressionHook | None:
    """The :class:`CompressionHook` registered on ``model`` by :func:`register_compression`."""
    return getattr(model, _ATTR, None)


def prime_buckets(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> bool:
    """Make DDP re-bucket now, so training never changes the bucket layout (collective).

    DDP re-buckets once, before the second forward, in the order gradients became ready in the
    first backward. Two things depend on the layout: compressor state (per bucket), and the
    order in which each gradient element is summed across ranks (a ring all-reduce starts each
    element's sum on the rank that owns its chunk of the bucket; at 3 ranks or more
    ``(a + b) + c`` and ``(b + c) + a`` differ in the last bits). So a run resumed at step ``k``
    whose step ``k + 1`` used the initial layout would continue the uninterrupted run (which
    re-bucketed after its step 1) only approximately. This runs one forward/backward of
    ``loss_fn`` with the compression hook passing gradients through untouched, then clears the
    gradients; random-number state is left as it was (buffers and other forward side effects
    are the caller's). Every rank must call it. ``loss_fn`` must build the graph of a training
    step (the same losses): the layout follows the order in which its gradients become ready.

    Args:
        model: The DDP model.
        loss_fn: Returns a scalar loss computed through ``model`` (every parameter used).

    Returns:
        Whether a backward was run (``False`` when DDP does not re-bucket: buckets already
        rebuilt, ``find_unused_parameters`` without ``static_graph``, or a model that is not DDP).
    """
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return False
    if getattr(model, "_has_rebuilt_buckets", True):
        return False
    if model.find_unused_parameters and not model.static_graph:  # DDP never re-buckets then
        return False
    hook = find_compression(model)
    device = next(model.parameters()).device
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if hook is not None:
            hook.passthrough = True
        try:
            loss_fn().backward()
        finally:
            if hook is not None:
                hook.passthrough = False
    model.zero_grad(set_to_none=True)
    return True
