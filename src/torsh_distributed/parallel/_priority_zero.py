"""ZeRO-2 for the priority exchange (private): reduce-scatter, sharded step, all-gather per chunk.

:class:`~torsh_distributed.parallel.priority.PriorityDataParallel` with ``zero_stage=2``. Each
chunk of the layout (:mod:`._chunks`) goes through three things in the exchange's thread:

1. **reduce-scatter** of its gradients (times ``1 / world``, as DDP and FSDP2's average on two
   ranks) once every rank has them, priority = chunk index (first layers first), as backward
   produces them;
2. **the optimizer step on this rank's shard** of the chunk (the optimizer state exists only for
   the shard: ZeRO's memory saving), once every rank has called ``submit()`` (the step's
   hyper-parameters are known everywhere);
3. **all-gather** of the updated shards into the replicated parameters, at the same priority:
   chunk 0's all-gather overtakes the reduce-scatters of later chunks still queued, so the next
   forward's first modules (each waiting in a pre-hook for its own parameters only) start while
   the rest of the exchange runs. This is the next step's all-gather of FSDP2, issued as soon as
   its own reduce-scatter and step are done rather than at the next forward.

Every message carries the readiness bitmap (one count per chunk plus one for "submitted"): the
reduce-scatter in every rank's row (summed), the all-gather in each rank's contribution (summed
after), so decisions depend only on completed messages and every rank takes the same ones.

Why not FSDP2 itself: on CPU/Gloo FSDP2 issues its reduce-scatter synchronously in backward's
hook (``foreach_reduce`` calls the collective without ``async_op``; its streams are no-ops on
CPU), all-gathers each unit at its forward (prefetching calls the same blocking ``unshard``
unless ``unshard(async_op=True)`` is called by hand), and steps the optimizer only after the
whole backward: nothing overlaps. Parameters here stay replicated between steps (the paper's
ZeRO-2; FSDP2's stage 2 holds shards between steps): more memory, no all-gather on the
forward's critical path.
"""

from __future__ import annotations

import collections
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.parallel._priority_exchange import Exchange, Op, Step

__all__ = ["ShardedExchange"]

DEFAULT_PARTITION = 1 << 20
"""``partition_bytes=0``: 1 MiB, half the chunks of 512 KiB (each costs two messages and an
optimizer call in a Python thread); the measured difference is within the loaded VM's noise
(docs/benchmarks.md). Not re-chosen from the link: the shards hang on it."""
RS, AG, ASK = 0, 1, 2  # message kinds: reduce-scatter, all-gather, bitmap only
_now = time.perf_counter


class ShardedExchange(Exchange):
    """The ZeRO-2 state machine (see the module doc); the thread and hooks are the parent's."""

    def __init__(self, params: list[nn.Parameter], **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        if self.auto[0]:  # each chunk costs two messages and an optimizer call here
            self.partition = DEFAULT_PARTITION
            self.credit = kwargs["credit_bytes"] or 2 * self.partition
            self.layout = self._layout()
        # the shards (and their optimizer state) hang on the layout: it is fixed from here on
        self.auto = (False, self.auto[1])
        self.rank = dist.get_rank(self.group)
        self.shards: list[list[tuple[int, nn.Parameter, int, int]]] = []
        self.shard_state: collections.defaultdict[torch.Tensor, dict[str, Any]] = (
            collections.defaultdict(dict)
        )
        self.group_of: dict[int, int] = {}
        self.kind_of: dict[int, int] = {}

    def bind(self, optimizer: torch.optim.Optimizer, *, grad_clip: float) -> None:
        if grad_clip:
            raise ValueError(
                "PriorityDataParallel(zero_stage=2) cannot clip gradients: each rank holds only "
                "its shards, so the global norm would need one more collective per step "
                "(use grad_clip 0 or zero_stage 0)"
            )
        super().bind(optimizer, grad_clip=0.0)
        if optimizer.state:
            raise ValueError("zero_stage=2 needs a fresh optimizer (its state lives in shards)")
        index = {id(p): i for i, p in enumerate(self.params)}
        self.group_of = {
            index[id(p)]: g
            for g, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        self._build_shards()

    def _width(self, chunk: int) -> int:
        return -(-self.layout.sizes[chunk] // self.world)

    def _build_shards(self) -> None:
        """Per chunk: (parameter, shard tensor, offset in this rank's row, length); shards are
        copies of the (synchronised) parameters, stepped by the optimizer."""
        self.shards = []
        for c, pieces in enumerate(self.layout.chunks):
            width = self._width(c)
            lo_row, hi_row = self.rank * width, (self.rank + 1) * width
            mine = []
            for piece in pieces:
                lo = max(piece.offset, lo_row)
                hi = min(piece.offset + piece.length, hi_row)
                if lo < hi:
                    flat = self.params[piece.param].detach().reshape(-1)
                    start = piece.start + lo - piece.offset
                    shard = nn.Parameter(flat[start : start + hi - lo].clone())
                    mine.append((piece.param, shard, lo - lo_row, hi - lo))
            self.shards.append(mine)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "zero_stage": 2}

    def sharded_state(self) -> dict[str, Any]:
        """This rank's optimizer state, per chunk and shard (what a checkpoint would save)."""
        return {
            f"{c}.{k}": dict(self.shard_state.get(shard, {}))
            for c, mine in enumerate(self.shards)
            for k, (_, shard, _, _) in enumerate(mine)
        }

    # --- the exchange thread ---------------------------------------------------------------

    def _bitmap(self, step: Step) -> torch.Tensor:
        submitted = step.submitted.is_set()  # read first: submit() marks every chunk ready before
        with self.cond:
            flags = [*map(float, step.ready), float(submitted)]
        return torch.tensor(flags, dtype=self.params[0].dtype)

    def _exchange(self, step: Step) -> None:
        if not self.shards:
            raise RuntimeError("PriorityDataParallel(zero_stage=2): bind(optimizer) first")
        n, layout = len(self.layout), self.layout
        rs_sent, agreed, updated, ag_sent = [False] * n, [False] * n, [False] * n, [False] * n
        reduced: list[torch.Tensor | None] = [None] * n
        left = [len(c) for c in layout.of_param]  # per parameter: chunks not yet gathered
        issued_rs = [len(c) for c in layout.of_param]  # per parameter: chunks not yet sent
        flags = {"submitted": False}
        inflight: deque[Op] = deque()
        inflight_bytes, gathered = 0, 0
        while gathered < n:
            if flags["submitted"]:
                for c in range(n):
                    if reduced[c] is not None and not updated[c]:
                        self._step_shard(step, c, reduced[c])
                        reduced[c], updated[c] = None, True
            nxt = next(
                (
                    c
                    for c in range(n)
                    if (updated[c] and not ag_sent[c]) or (agreed[c] and not rs_sent[c])
                ),
                -1,
            )
            size = self._width(nxt) * self.world * self.elem if nxt >= 0 else 0
            if nxt >= 0 and (not inflight or inflight_bytes + size <= self.credit):
                if updated[nxt]:
                    inflight.append(self._gather(step, nxt))
                    ag_sent[nxt] = True
                else:
                    inflight.append(self._scatter(step, nxt, issued_rs))
                    rs_sent[nxt] = True
                inflight_bytes += size
                continue
            if inflight:
                op = inflight.popleft()
                inflight_bytes -= self._width(op.chunk) * self.world * self.elem
                kind, counts = self._finish(op, reduced, left)
                gathered += kind == AG
                self._agree(counts, agreed, flags)
                continue
            with self.cond:  # nothing agreed to send: wait for news here, then ask
                while not self.closing and not (
                    any(step.ready[c] and not rs_sent[c] for c in range(n))
                    or (step.submitted.is_set() and not flags["submitted"])
                ):
                    self.cond.wait(0.5)
                if self.closing:
                    raise RuntimeError("closed during an exchange")
            _, counts = self._finish(self._ask(step), reduced, left)
            self._agree(counts, agreed, flags)
        self._measure()

    def _agree(self, counts: list[float], agreed: list[bool], flags: dict[str, bool]) -> None:
        for c, count in enumerate(counts[:-1]):
            if count == self.world:
                agreed[c] = True
        if counts[-1] == self.world:
            flags["submitted"] = True

    def _track(self, op: Op, kind: int) -> Op:
        self.kind_of[id(op)] = kind
        try:
            op.work.get_future().add_done_callback(lambda _: op.done_at.append(_now()))
        except RuntimeError:  # gloo's reduce-scatter has no future: timed when waited for
            pass
        return op

    def _scatter(self, step: Step, chunk: int, issued_rs: list[int]) -> Op:
        width, m = self._width(chunk), len(self.layout) + 1
        flat = torch.zeros(width * self.world, dtype=self.params[0].dtype)
        scale = 1.0 / self.world
        for piece in self.layout.chunks[chunk]:
            p = self.params[piece.param]
            out = flat[piece.offset : piece.offset + piece.length]
            if p.grad is not None:  # DDP's arithmetic: the gradient times 1/world
                torch.mul(
                    p.grad.reshape(-1)[piece.start : piece.start + piece.length], scale, out=out
                )
            issued_rs[piece.param] -= 1
            if issued_rs[piece.param] == 0:
                p.grad = None  # every piece is in a buffer: the full gradient is not kept
        buf = torch.empty(self.world, width + m, dtype=flat.dtype)
        buf[:, :width] = flat.view(self.world, width)
        buf[:, width:] = self._bitmap(step)
        out = torch.empty(width + m, dtype=flat.dtype)
        issued = _now()
        work = dist.reduce_scatter_single(out, buf.view(-1), group=self.group, async_op=True)
        # bytes as an all-reduce's: a reduce-scatter (or all-gather) of N moves half of one of N
        op = Op(chunk=chunk, buf=out, nbytes=buf.numel() * self.elem // 2, issued=issued,
                 work=work, clean=True)  # fmt: skip
        return self._track(op, RS)

    def _step_shard(self, step: Step, chunk: int, reduced: torch.Tensor) -> None:
        optimizer = self.optimizer
        assert optimizer is not None
        per_group: dict[int, list[nn.Parameter]] = {}
        for index, shard, offset, length in self.shards[chunk]:
            shard.grad = reduced[offset : offset + length]
            per_group.setdefault(self.group_of.get(index, -1), []).append(shard)
        groups = [{**step.hyper[g], "params": ps} for g, ps in per_group.items() if g >= 0]
        if groups:
            view = type(optimizer).__new__(type(optimizer))  # this chunk's shards, their state
            view.__setstate__(
                {"defaults": optimizer.defaults, "state": self.shard_state, "param_groups": groups}
            )
            view.step()
        for _, shard, _, _ in self.shards[chunk]:
            shard.grad = None

    def _gather(self, step: Step, chunk: int) -> Op:
        width, m = self._width(chunk), len(self.layout) + 1
        mine = torch.zeros(width + m, dtype=self.params[0].dtype)
        for _, shard, offset, length in self.shards[chunk]:
            mine[offset : offset + length] = shard.detach()
        mine[width:] = self._bitmap(step)
        out = torch.empty(self.world, width + m, dtype=mine.dtype)
        issued = _now()
        work = dist.all_gather_single(out.view(-1), mine, group=self.group, async_op=True)
        op = Op(chunk=chunk, buf=out, nbytes=out.numel() * self.elem // 2, issued=issued,
                 work=work, clean=True)  # fmt: skip
        return self._track(op, AG)

    def _ask(self, step: Step) -> Op:
        buf = self._bitmap(step)
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        op = Op(chunk=-1, buf=buf, nbytes=0, issued=_now(), work=work, clean=False)
        return self._track(op, ASK)

    def _finish(
        self, op: Op, reduced: list[torch.Tensor | None], left: list[int]
    ) -> tuple[int, list[float]]:
        """Wait for ``op``; keep a reduce-scatter's shard, copy an all-gather into the
        parameters (releasing their forward pre-hooks); its kind and the summed bitmap."""
        op.work.wait()
        kind = self.kind_of.pop(id(op))
        if op.clean:
            self.timeline.append((op.issued, op.done_at[0] if op.done_at else _now(), op.nbytes))
        if kind == ASK:
            return kind, op.buf.tolist()
        width = self._width(op.chunk)
        if kind == RS:
            reduced[op.chunk] = op.buf[:width]
            return kind, op.buf[width:].tolist()
        full = op.buf[:, :width].reshape(-1)
        with torch.no_grad():
            for piece in self.layout.chunks[op.chunk]:
                p = self.params[piece.param]
                p.data.view(-1)[piece.start : piece.start + piece.length].copy_(
                    full[piece.offset : piece.offset + piece.length]
                )
                left[piece.param] -= 1
                if left[piece.param] == 0:
                    self.events[piece.param].set()
        return kind, op.buf[:, width:].sum(dim=0).tolist()
