"""Collectives among the ranks of one node through one shared-memory segment.

Layout: a 4 KiB header (magic, rank count, pids), one 64-byte flag per rank, then two slots
(double buffering) of ``slot_bytes`` per rank. Every collective is a sequence of *phases*: a rank
writes into its own slot, publishes the phase number in its flag (release), and waits until
every flag reaches it (acquire). Large tensors go in chunks of a slot; chunk ``k`` uses slot
parity ``k % 2`` (``k`` counts chunks over all collectives), so a fast rank copies chunk ``k + 1``
in while a slow one still reads chunk ``k`` (a rank cannot write chunk ``k + 2`` before every rank
has finished reading chunk ``k``: it would have to pass chunk ``k + 1``'s first phase, which every
rank joins only after reading).

All-reduce is reduce-scatter then all-gather over the slots: after the first phase rank ``r``
reduces the ``r``-th part of the chunk across all slots, publishes it (second phase), and every
rank copies the parts of the others. Reduction order (fixed, documented in docs/shm.md): a left
fold over local ranks ``((x0 op x1) op x2) ...``; float16/bfloat16 accumulate in float32 and
round once at the end; AVG divides the sum by the group size (after the float32 accumulation).
Tensors up to ``small_bytes`` take one phase instead: every rank folds the whole tensor itself
in the same order (same result, bit for bit, less waiting).

Every wait has a deadline. A peer that does not arrive raises :class:`DistributedTimeoutError`
naming its global rank and the operation; a peer whose process has exited raises it at once.
After such an error the transport is broken (ranks are out of step) and refuses further calls.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from torsh_distributed.runtime._shm_kernels import KINDS as _KINDS
from torsh_distributed.runtime._shm_kernels import NATIVE_DTYPES, NATIVE_OPS
from torsh_distributed.runtime._shm_segment import HEADER_BYTES, Segment, _alive
from torsh_distributed.runtime._shm_sync import FLAG_BYTES, Flags
from torsh_distributed.runtime.errors import CommunicationError, DistributedTimeoutError

__all__ = ["REDUCE_OPS", "ShmTransport", "segment_bytes", "supports"]

REDUCE_OPS = ("sum", "avg", "product", "min", "max")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
)
_ALIGN = 64  # bytes: parts start on cache lines
DEFAULT_CHUNK_BYTES = 256 << 10  # native all-reduce: stays in the caches between ranks
DEFAULT_MAX_PHASES = 8  # larger tensors take larger chunks, up to a third of a slot (341 KiB)
_FOLD: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add,
    "avg": torch.add,
    "product": torch.mul,
    "min": torch.minimum,
    "max": torch.maximum,
}


_F = TypeVar("_F", bound=Callable[..., Any])


def _serialised(method: _F) -> _F:
    """One collective at a time per transport: a second thread waits instead of mixing slots."""

    @functools.wraps(method)
    def call(self: ShmTransport, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def _layout(num_ranks: int) -> int:
    flags = -(-num_ranks * FLAG_BYTES // 4096) * 4096
    return HEADER_BYTES + flags


def segment_bytes(num_ranks: int, slot_bytes: int) -> int:
    """Size of the segment for ``num_ranks`` ranks with slots of ``slot_bytes``."""
    return _layout(num_ranks) + 2 * num_ranks * slot_bytes


def supports(tensor: torch.Tensor, op: str | None = None) -> bool:
    """Whether the transport handles ``tensor`` (CPU, contiguous, a listed dtype) with ``op``."""
    if tensor.device.type != "cpu" or tensor.dtype not in DTYPES or not tensor.is_contiguous():
        return False
    if op == "avg" and not tensor.dtype.is_floating_point:
        return False
    return op is None or op in REDUCE_OPS


class ShmTransport:
    """The shared-memory collectives of one node's group (``local_rank`` of ``num_ranks``).

    Args:
        segment: The mapped segment (see ``segment_bytes`` for its size).
        local_rank: This rank's index in the node's group.
        global_ranks: Global rank of each local rank (for error messages).
        slot_bytes: Bytes per slot: the chunk size of the pipeline. Larger chunks mean fewer
            phases (less synchronisation) but more memory and less overlap.
        timeout_s: Deadline of every wait.
        small_bytes: All-reduces up to this size take the one-phase path.
        max_phases: The native kernels use chunks of at least ``total / max_phases`` bytes (up
            to a third of a slot): every chunk is a phase that every rank must reach, and on a
            busy host a descheduled peer stalls each one, so large tensors go in few phases.
        chunk_bytes: Smallest chunk of the native (C) all-reduce, which keeps three buffers in one
            half of each rank's slot pair (so at most ``slot_bytes / 3``).
        lib: The compiled flag helper (``None``: x86-64 Python fallback).
    """

    def __init__(
        self,
        segment: Segment,
        *,
        local_rank: int,
        global_ranks: Sequence[int],
        slot_bytes: int,
        timeout_s: float,
        small_bytes: int = 32 << 10,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_phases: int = DEFAULT_MAX_PHASES,
        lib: ctypes.CDLL | None = None,
    ) -> None:
        if max_phases < 1:
            raise ValueError(f"max_phases must be >= 1, got {max_phases}")
        self.max_phases = max_phases
        self.segment = segment
        self.rank = local_rank
        self.size = len(global_ranks)
        self.global_ranks = list(global_ranks)
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.small_bytes = small_bytes
        self._seq = 0
        self._hot = 0
        self.kernel_calls: Counter[str] = Counter()
        """Collectives run by the C kernel, by kind (none without the compiled helper)."""
        self.chunk_bytes = chunk_bytes
        self._slot_base = ctypes.addressof(ctypes.c_char.from_buffer(segment.mm)) + _layout(
            len(global_ranks)
        )
        self._broken: str | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        base = ctypes.addressof(ctypes.c_char.from_buffer(segment.mm))
        self._flags = Flags(base + HEADER_BYTES, self.size, lib)
        self._lib = lib
        self._native_ok = lib is not None and self.size <= 64  # the kernels' source arrays
        raw = torch.frombuffer(segment.mm, dtype=torch.uint8)
        start = _layout(self.size)
        self._slots = [
            [
                raw[start + (2 * j + p) * slot_bytes : start + (2 * j + p + 1) * slot_bytes]
                for p in range(2)
            ]
            for j in range(self.size)
        ]

    # -- synchronisation ---------------------------------------------------------------------

    def _check_usable(self, op: str) -> None:
        if self._broken:
            raise CommunicationError(
                f"the shared-memory transport is unusable after an earlier failure ({self._broken})",
                rank=self.global_ranks[self.rank],
                operation=op,
                fix="destroy the process group and start again.",
            )

    def _phase(self, op: str) -> None:
        self._check_usable(op)
        self._seq += 1
        self._flags.store(self.rank, self._seq)
        self._await(op, lambda budget: self._flags.wait_all(self._seq, budget))

    def _await(self, op: str, wait: Callable[[float], int]) -> None:
        """Call ``wait(budget_s)`` (-1: done, else the lagging local rank) until done or failed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            lagging = wait(max(min(left, 0.25), 0.0))
            if lagging < 0:
                return
            if self._cancelled:
                self._broken = f"{op} cancelled"
                raise CommunicationError(
                    f"{op} over shared memory was cancelled: the process group is shutting down",
                    rank=self.global_ranks[self.rank],
                    operation=op,
                )
            pid = self.segment.pid(lagging)
            dead = pid > 0 and not _alive(pid)
            if dead or time.monotonic() >= deadline:
                peer = self.global_ranks[lagging]
                why = (
                    f"its process (pid {pid}) has exited"
                    if dead
                    else f"it did not arrive within {self.timeout_s:g} s"
                )
                self._broken = f"rank {peer} missing in {op}"
                raise DistributedTimeoutError(
                    f"rank {peer} did not reach {op} over shared memory: {why}",
                    rank=self.global_ranks[self.rank],
                    operation=op,
                    fix=f"look at rank {peer}'s log or stack; every rank must call the same "
                    "collectives in the same order.",
                )

    @_serialised
    def barrier(self) -> None:
        self._phase("barrier")

    # -- helpers ---------------------------------------------------------------------------

    def _next_parity(self) -> int:
        # The halves of every rank's slot pair alternate, the same on every rank: a chunk (or a
        # native collective) writes the half the previous one did not end in, which every rank
        # has finished reading (it passed a later phase). Readers of the last phase of the
        # previous collective may still be in the other half.
        self._hot = 1 - self._hot
        return self._hot

    def _slot(self, j: int, parity: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        return self._slots[j][parity][: count * dtype.itemsize].view(dtype)

    def _chunk_elems(self, dtype: torch.dtype, parts: int = 1) -> int:
        per = self.slot_bytes // parts // dtype.itemsize
        return max(per // (_ALIGN // dtype.itemsize) * (_ALIGN // dtype.itemsize), 1)

    def _fold(
        self, out: torch.Tensor, sources: Sequence[torch.Tensor], op: str, divide: int
    ) -> None:
        """``out = ((s0 op s1) op s2) ...`` (then / divide), in float32 for half types.

        ``out`` may be one of the sources (this rank's own data, read from its tensor rather than
        from its slot): elementwise ops may write the input they read, but a source after the
        first two would be overwritten before its turn, so then the fold goes through a buffer.
        """
        fn = _FOLD[op]
        half = out.dtype in (torch.float16, torch.bfloat16)
        if half:
            target = sources[0].float()
            rest = sources[1:]
        else:
            late = any(src.data_ptr() == out.data_ptr() for src in sources[2:])
            target = torch.empty_like(out) if late else out
            if len(sources) == 1:
                target.copy_(sources[0])
            else:
                fn(sources[0], sources[1], out=target)
            rest = sources[2:]
        for src in rest:
            fn(target, src, out=target)
        if divide > 1:
            target.div_(divide)
        if target is not out:
            out.copy_(target)

    # -- collectives -----------------------------------------------------------------------

    @_serialised
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, divide: int = 0) -> None:
        """Reduce ``tensor`` (flat view of a contiguous tensor) across the node, in place.

        ``divide``: divide the result by this (AVG; 0 means the group size for ``avg``).
        """
        flat = tensor.view(-1)
        if op == "avg" and not divide:
            divide = self.size
        if self.size == 1:
            if divide > 1:
                self._fold(flat, [flat], op, divide)
            return
        if self._native_ok and flat.dtype in NATIVE_DTYPES:
            self._native("all_reduce", f"all_reduce({op})", flat, op=op, divide=divide)
            return
        if flat.numel() * flat.element_size() <= min(self.small_bytes, self.slot_bytes):
            self._all_reduce_small(flat, op, divide)
            return
        n = flat.numel()
        step = self._chunk_elems(flat.dtype)
        name = f"all_reduce({op})"
        for lo in range(0, n, step):
            count = min(step, n - lo)
            parity = self._next_parity()
            chunk = flat[lo : lo + count]
            mine = self._slot(self.rank, parity, flat.dtype, count)
            bounds = self._parts(count, flat.dtype)
            a, b = bounds[self.rank], bounds[self.rank + 1]
            # publish the parts the others reduce; our own part we read from the tensor
            mine[:a].copy_(chunk[:a])
            mine[b:].copy_(chunk[b:])
            self._phase(name)
            if b > a:
                sources = [
                    chunk[a:b] if j == self.rank else self._slot(j, parity, flat.dtype, count)[a:b]
                    for j in range(self.size)
                ]
                self._fold(chunk[a:b], sources, op, divide)
                mine[a:b].copy_(chunk[a:b])
            self._phase(name)
            for j in range(self.size):
                a, b = bounds[j], bounds[j + 1]
                if j != self.rank and b > a:
                    chunk[a:b].copy_(self._slot(j, parity, flat.dtype, count)[a:b])

    def _native(
        self,
        kind: str,
        name: str,
        data: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        op: str = "sum",
        divide: int = 0,
        root: int = 0,
    ) -> None:
        """Run one collective in the C kernel (see ``_shm_kernels``); ``data`` is flat.

        Broadcast and all-gather move bytes (any dtype); all-reduce and reduce-scatter fold
        elements of a ``NATIVE_DTYPES`` dtype. For all-gather and reduce-scatter ``data``/``out``
        hold ``size`` rows of the per-rank count.
        """
        self._check_usable(name)
        lib = self._lib
        assert lib is not None
        self.kernel_calls[kind] += 1
        folds = kind in ("all_reduce", "reduce_scatter")
        isz = data.element_size() if folds else 1
        count = data.numel() * data.element_size() // isz
        if kind == "reduce_scatter":
            count //= self.size
        rows = self.size if kind == "reduce_scatter" else 1
        unit = _ALIGN // isz
        target = max(self.chunk_bytes, -(-count * isz * rows // self.max_phases))
        chunk = max(min(target, self.slot_bytes // 3) // rows // isz // unit * unit, unit)
        if count == 0:  # no phase: the halves must not alternate either (see _next_parity)
            return
        small = kind == "all_reduce" and count * isz <= min(self.small_bytes, chunk * isz)
        state = (ctypes.c_int64 * 3)(self._seq, 0, 0)
        args = (
            _KINDS[kind],
            self._slot_base,
            2 * self.slot_bytes,
            self._next_parity() * self.slot_bytes,
            chunk * rows * isz,
            self._flags.address,
            FLAG_BYTES // 8,
            self.size,
            self.rank,
            root,
            data.data_ptr(),
            0 if out is None else out.data_ptr(),
            count,
            isz,
            NATIVE_DTYPES.get(data.dtype, -1) if folds else -1,
            NATIVE_OPS.get(op, 0),
            float(divide),
            chunk,
            int(small),
            state,
        )

        def wait(budget_s: float) -> int:
            lagging = int(lib.torsh_collective(*args, int(budget_s * 1e9)))
            self._seq = state[0]
            if lagging == -2:
                raise CommunicationError(
                    f"the shared-memory kernel refused {name} (dtype {data.dtype})",
                    rank=self.global_ranks[self.rank],
                    operation=name,
                )
            return lagging

        self._await(name, wait)

    def _parts(self, count: int, dtype: torch.dtype) -> list[int]:
        unit = max(_ALIGN // dtype.itemsize, 1)
        per = -(-count // self.size)
        per = -(-per // unit) * unit
        return [min(i * per, count) for i in range(self.size + 1)]

    def _all_reduce_small(self, flat: torch.Tensor, op: str, divide: int) -> None:
        parity = self._next_parity()
        count = flat.numel()
        self._slot(self.rank, parity, flat.dtype, count).copy_(flat)
        self._phase(f"all_reduce({op})")
        sources = [
            flat if j == self.rank else self._slot(j, parity, flat.dtype, count)
            for j in range(self.size)
        ]
        self._fold(flat, sources, op, divide)

    @_serialised
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", *, divide: int = 0
    ) -> None:
        """``output`` (n elements) = reduction of part ``local_rank`` of ``input`` (size x n)."""
        out = output.view(-1)
        n = out.numel()
        src = input.view(self.size, n)
        if op == "avg" and not divide:
            divide = self.size
        if self.size == 1:
            self._fold(out, [src[0]], op, divide)
            return
        # the kernel's buffer holds a row of at least 64 B per rank, three times over
        if (
            self._native_ok
            and out.dtype in NATIVE_DTYPES
            and 3 * _ALIGN * self.size <= self.slot_bytes
        ):
            name = f"reduce_scatter({op})"
            self._native("reduce_scatter", name, src, out, op=op, divide=divide)
            return
        step = self._chunk_elems(out.dtype, parts=self.size)
        name = f"reduce_scatter({op})"
        for lo in range(0, n, step):
            count = min(step, n - lo)
            parity = self._next_parity()
            me = self.rank
            mine = self._slot(me, parity, out.dtype, count * self.size).view(self.size, count)
            mine[:me].copy_(src[:me, lo : lo + count])  # every part but ours, which we keep
            mine[me + 1 :].copy_(src[me + 1 :, lo : lo + count])
            self._phase(name)
            sources = [
                src[me, lo : lo + count]
                if j == me
                else self._slot(j, parity, out.dtype, count * self.size)[
                    me * count : (me + 1) * count
                ]
                for j in range(self.size)
            ]
            self._fold(out[lo : lo + count], sources, op, divide)

    @_serialised
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (size x n elements) = every rank's ``input`` (n elements), in rank order."""
        src = input.view(-1)
        n = src.numel()
        out = output.view(self.size, n)
        if self.size == 1:
            out[0].copy_(src)
            return
        if self._native_ok:
            self._native("all_gather", "all_gather", src, out)
            return
        step = self._chunk_elems(src.dtype)
        for lo in range(0, n, step):
            count = min(step, n - lo)
            parity = self._next_parity()
            self._slot(self.rank, parity, src.dtype, count).copy_(src[lo : lo + count])
            self._phase("all_gather")
            for j in range(self.size):
                mine = j == self.rank  # our own part: from the input, still in cache
                part = src[lo : lo + count] if mine else self._slot(j, parity, src.dtype, count)
                out[j, lo : lo + count].copy_(part)

    @_serialised
    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Copy local rank ``root``'s ``tensor`` into every rank's, in place."""
        flat = tensor.view(-1)
        if self.size == 1:
            return
        if self._native_ok:
            self._native("broadcast", "broadcast", flat, root=root)
            return
        n = flat.numel()
        step = self._chunk_elems(flat.dtype)
        for lo in range(0, n, step):
            count = min(step, n - lo)
            parity = self._next_parity()
            if self.rank == root:
                self._slot(root, parity, flat.dtype, count).copy_(flat[lo : lo + count])
            self._phase("broadcast")
            if self.rank != root:
                flat[lo : lo + count].copy_(self._slot(root, parity, flat.dtype, count))

    def cancel(self) -> None:
        """Make a collective waiting for a peer (in another thread) give up within 0.25 s."""
        self._cancelled = True

    def close(self) -> None:
        self._slots = []
        self.segment.close()
