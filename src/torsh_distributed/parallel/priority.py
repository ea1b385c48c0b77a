"""Priority scheduling of the data-parallel gradient exchange (ByteScheduler's idea, our code).

DDP all-reduces gradient buckets in the order backward produces them (last layer first) and
the optimizer steps after the last one, so the next forward, which needs the *first* layer
first, waits for the whole exchange. :class:`PriorityDataParallel` replaces DDP for plain data
parallelism and reorders the exchange (Peng et al., "A Generic Communication Scheduler for
Distributed DNN Training Acceleration", SOSP '19):

* **partitioning**: parameters (forward order) are cut and merged into chunks of
  ``partition_bytes`` (:mod:`._chunks`); a chunk's index is its priority;
* **priority with credit**: a background thread all-reduces ready chunks highest priority first,
  with at most ``credit_bytes`` in flight, so a first-layer chunk produced late in backward
  overtakes the queued last-layer ones (what is already on the wire is not preempted);
* **per-chunk update**: when the last chunk of a parameter arrives the optimizer steps that
  parameter (a view of the user's optimizer holding just those parameters: same hyper-parameters
  and state), and the next step's forward starts at once: each module's forward pre-hook waits
  only for its own parameters' update.

Every rank must issue the same all-reduces in the same order, but readiness is timed locally.
So each message carries a readiness bitmap (one float per chunk, summed): a chunk is sent only
once every rank reported it ready in a message already completed, and when nothing agreed is
left to send a bitmap-only message asks again. Decisions depend only on completed messages, so
every rank takes the same ones. Sums and the optimizer arithmetic are DDP's (gradients times
``1 / world`` then summed; the same optimizer kernels per tensor): on 2 ranks the result is
bit-identical to DDP (``tests/distributed/test_comm_schedule.py``); on more, gloo's ring
sums a chunk in an order that depends on its boundaries (equal within rounding).

``zero_stage=2`` (:mod:`._priority_zero`) does the same for ZeRO-2: each chunk is
reduce-scattered, this rank's shard stepped, and the updated chunk all-gathered at the same
priority (bit-identical to FSDP2's ``fully_shard(reshard_after_forward=False)`` on 2 ranks).

Limits: with gradient clipping every update needs the global norm, so updates wait for the
whole exchange (the order still helps, the overlap with the next forward is lost); a module
whose forward reads another module's parameter directly is only safe when autograd saved it
(a stale read then raises in backward); parameters must share one dtype.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.comm.bandwidth import BandwidthEstimator, LinkEstimate, choose_partition
from torsh_distributed.parallel._chunks import ChunkLayout, plan_chunks

__all__ = ["PriorityDataParallel"]

DEFAULT_PARTITION = 512 << 10
AUTO_AFTER_STEPS = 3
"""``auto``: steps of measurements before the partition and credit are chosen from the link."""


@dataclass(slots=True)
class _Op:
    chunk: int  # -1: a bitmap-only message
    buf: torch.Tensor
    nbytes: int
    issued: float
    work: Any
    clean: bool  # a payload: its time is the link's (a bitmap-only one waits for backward)
    done_at: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Step:
    missing: list[int]  # per chunk: its parameters not yet ready here
    ready: list[bool]  # per chunk: every parameter's gradient is final here
    left: list[int]  # per parameter: its chunks not yet reduced
    submitted: threading.Event = field(default_factory=threading.Event)
    hyper: list[dict[str, Any]] = field(default_factory=list)


class PriorityDataParallel(nn.Module):
    """Data parallelism with a prioritised, partitioned gradient exchange (see the module doc).

    The engine's ``--comm-schedule priority`` builds it in place of DDP. Use::

        model = PriorityDataParallel(net, group=side_group("priority_dp"))
        model.bind(optimizer)
        for x, y in batches:
            loss = loss_fn(model(x), y)   # waits per module for the previous step's update
            loss.backward()               # chunks leave as they become ready everywhere
            model.submit()                # instead of optimizer.step() / zero_grad()
        model.wait()                      # before reading parameters or optimizer state

    Args:
        module: The model (parameters on this rank's device, one dtype).
        group: A process group used by nothing else (a background thread issues its
            collectives: sharing the default group with the main thread's would interleave
            them differently on different ranks); see ``comm.dims.side_group``.
        partition_bytes: Chunk size; 0 = auto (512 KiB, then chosen from the measured link
            after 3 steps). Smaller: finer priorities, more per-message latency.
        credit_bytes: Bytes of chunks in flight; 0 = auto (two partitions, then at least the
            bandwidth-delay product). Smaller: a high-priority chunk overtakes sooner; larger:
            a long-latency link stays busy.
        init_sync: Broadcast rank 0's parameters and buffers (as DDP does at wrap time).
        zero_stage: 0 = all-reduce chunks, every rank steps every parameter (DDP); 2 =
            reduce-scatter chunks, each rank steps its shard (optimizer state for 1/world of
            the model), then all-gather the updated chunk at the same priority
            (:mod:`._priority_zero`; no gradient clipping; ``partition_bytes`` stays fixed,
            1 MiB when 0).
        log: Where rank 0 reports the ``auto`` decision (``print`` by default).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup,
        partition_bytes: int = 0,
        credit_bytes: int = 0,
        init_sync: bool = True,
        zero_stage: int = 0,
        log: Callable[[str], None] = print,
    ) -> None:
        super().__init__()
        self.module = module
        params = list(module.parameters())  # forward order = registration order (a proxy)
        if not params:
            raise ValueError("PriorityDataParallel needs a module with parameters")
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"PriorityDataParallel needs one parameter dtype, got {sorted(map(str, dtypes))}"
            )
        if partition_bytes < 0 or credit_bytes < 0:
            raise ValueError("partition_bytes and credit_bytes must be >= 0 (0 = auto)")
        if zero_stage not in (0, 2):
            raise ValueError(
                f"PriorityDataParallel implements zero_stage 0 and 2, got {zero_stage}"
            )
        exchange: type[_Exchange] = _Exchange
        if zero_stage == 2:  # imported here: it subclasses _Exchange
            from torsh_distributed.parallel._priority_zero import ShardedExchange

            exchange = ShardedExchange
        self._x = exchange(
            params, group=group, partition_bytes=partition_bytes, credit_bytes=credit_bytes, log=log
        )
        self.zero_stage = zero_stage
        if init_sync:
            with torch.no_grad():
                for tensor in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)
        index = {id(p): i for i, p in enumerate(params)}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._x.grad_ready(i))
            for i, p in enumerate(params)
        ]
        for sub in module.modules():
            own = [
                index[id(p)] for p in sub._parameters.values() if p is not None and id(p) in index
            ]
            if own:
                self._handles.append(sub.register_forward_pre_hook(self._x.waiter(own)))
        self._sync = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        self._x.after_forward(arm=self._sync and torch.is_grad_enabled())
        return out

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """``False``: backward passes accumulate locally (``no_grad_sync``, grad accumulation)."""
        self._sync = requires

    def bind(self, optimizer: torch.optim.Optimizer, *, grad_clip: float = 0.0) -> None:
        """The optimizer whose step :meth:`submit` applies per chunk; ``grad_clip`` > 0 clips
        the global norm first (the updates then wait for the whole exchange)."""
        self._x.bind(optimizer, grad_clip=grad_clip)

    def submit(self) -> None:
        """After backward: take the optimizer's hyper-parameters (lr) for this step and let the
        updates proceed; returns at once. Parameters' gradients are consumed (left ``None``)."""
        self._x.submit()

    def wait(self) -> None:
        """Block until this step's exchange and updates are done (re-raises the thread's error)."""
        self._x.wait()

    @property
    def estimator(self) -> BandwidthEstimator:
        return self._x.estimator

    @property
    def link(self) -> LinkEstimate | None:
        """The link fit after the last completed step (``None`` until there are samples)."""
        return self._x.link

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The norm before clipping of the last step that clipped (``None`` without clipping)."""
        return self._x.grad_norm

    def summary(self) -> dict[str, Any]:
        """``schedule``, ``partition_kb``, ``credit_kb``, ``bandwidth`` (the link fit), ``decisions``."""
        return self._x.summary()

    def close(self) -> None:
        """Stop the exchange thread (idempotent); removes the hooks."""
        self._x.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _Exchange:
    """The state machine and thread behind :class:`PriorityDataParallel`."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        group: dist.ProcessGroup,
        partition_bytes: int,
        credit_bytes: int,
        log: Callable[[str], None],
    ) -> None:
        self.params, self.group, self.log = params, group, log
        self.world = dist.get_world_size(group)
        self.main = dist.get_rank(group) == 0
        self.elem = params[0].element_size()
        self.auto = (partition_bytes == 0, credit_bytes == 0)
        self.partition = partition_bytes or DEFAULT_PARTITION
        self.credit = credit_bytes or 2 * self.partition
        self.layout = self._layout()
        self.estimator = BandwidthEstimator(world_size=max(self.world, 2))
        self.decisions: list[str] = []
        self.link: LinkEstimate | None = None  # the last fit (read by any thread)
        self.optimizer: torch.optim.Optimizer | None = None
        self.grad_clip = 0.0
        self.grad_norm: torch.Tensor | None = None
        self.events = [threading.Event() for _ in params]
        for event in self.events:
            event.set()
        self.state = "idle"  # idle -> armed (forward done) -> submitted (backward done) -> idle
        self.step: _Step | None = None
        self.steps = 0
        self.cond = threading.Condition()
        self.idle = threading.Event()
        self.idle.set()
        self.error: BaseException | None = None
        self.closing = False
        self.timeline: list[tuple[float, float, int]] = []  # (issued, done, bytes) of payloads
        self.jobs: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="priority-exchange", daemon=True)
        self.thread.start()

    def _layout(self) -> ChunkLayout:
        return plan_chunks([p.numel() for p in self.params], max(self.partition // self.elem, 1))

    # --- main thread -----------------------------------------------------------------------

    def bind(self, optimizer: torch.optim.Optimizer, *, grad_clip: float) -> None:
        mine = {id(p) for p in self.params}
        theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not theirs <= mine:
            raise ValueError("the optimizer holds parameters that are not the wrapped module's")
        self.optimizer, self.grad_clip = optimizer, grad_clip

    def grad_ready(self, index: int) -> Callable[[torch.Tensor], None]:
        chunks = lambda: self.layout.of_param[index]  # noqa: E731 (the layout may change)

        def hook(_: torch.Tensor) -> None:
            step = self.step
            if self.state != "armed" or step is None:
                return
            with self.cond:
                for c in chunks():
                    step.missing[c] -= 1
                    if step.missing[c] == 0:
                        step.ready[c] = True
                self.cond.notify_all()

        return hook

    def waiter(self, own: list[int]) -> Callable[[nn.Module, Any], None]:
        events = [self.events[i] for i in own]

        def pre_hook(_: nn.Module, __: Any) -> None:
            for event in events:
                while not event.wait(0.5):
                    self._raise()
            self._raise()

        return pre_hook

    def after_forward(self, *, arm: bool) -> None:
        if self.state == "submitted":
            self.wait()  # every update of the last step (a parameter read outside a module)
        if arm and self.state == "idle":
            self._raise()
            n = len(self.layout)
            missing = [0] * n
            for pieces_of in self.layout.of_param:
                for c in pieces_of:
                    missing[c] += 1
            self.step = _Step(
                missing=missing,
                ready=[m == 0 for m in missing],
                left=[len(c) for c in self.layout.of_param],
            )
            self.state = "armed"
            self.idle.clear()
            self.jobs.put(self.step)

    def submit(self) -> None:
        if self.state != "armed":
            return  # no synchronising forward/backward this step
        if self.optimizer is None:
            raise RuntimeError("PriorityDataParallel.submit() before bind(optimizer)")
        step = self.step
        assert step is not None
        step.hyper = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        for event in self.events:  # cleared only now: a recomputing (checkpointed) forward
            event.clear()  # inside backward must not wait for this step's own update
        self.state = "submitted"
        with self.cond:  # parameters backward did not reach count as ready (zero gradients)
            for c, m in enumerate(step.missing):
                if m:
                    step.missing[c], step.ready[c] = 0, True
            self.cond.notify_all()
        step.submitted.set()

    def wait(self) -> None:
        if self.state == "armed":
            return  # nothing was exchanged: the parameters are those of the last update
        while not self.idle.wait(0.5):
            self._raise()
        self.state = "idle"
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"the priority gradient exchange failed: {self.error}"
            ) from self.error

    def close(self) -> None:
        if self.closing:
            return
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.step is not None:
            self.step.submitted.set()
        self.jobs.put(None)
        self.thread.join(timeout=10)

    def summary(self) -> dict[str, Any]:
        link = self.link
        return {
            "schedule": "priority",
            "zero_stage": 0,
            "partition_kb": self.partition // 1024,
            "credit_kb": self.credit // 1024,
            "chunks": len(self.layout),
            "bandwidth": link.to_dict() if link is not None else {},
            "decisions": list(self.decisions),
        }

    # --- the exchange thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            step = self.jobs.get()
            if step is None:
                return
            try:
                self._exchange(step)
                self.link = self.estimator.estimate()  # here: the thread owns the samples
                self.steps += 1
                if self.steps == AUTO_AFTER_STEPS and any(self.auto):
                    self._decide()
            except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
                self.error = exc
                for event in self.events:
                    event.set()
            finally:
                self.idle.set()

    def _exchange(self, step: _Step) -> None:
        layout, n = self.layout, len(self.layout)
        sent, agreed = [False] * n, [False] * n
        inflight: deque[_Op] = deque()
        inflight_bytes, completed, done_params = 0, 0, []
        while completed < n:
            nxt = next((c for c in range(n) if agreed[c] and not sent[c]), -1)
            size = layout.sizes[nxt] * self.elem if nxt >= 0 else 0
            if nxt >= 0 and (not inflight or inflight_bytes + size <= self.credit):
                inflight.append(self._issue(step, nxt))
                sent[nxt] = True
                inflight_bytes += size
                continue
            if inflight:
                op = inflight.popleft()
                inflight_bytes -= op.nbytes - n * self.elem
                done_params += self._complete(step, op, agreed)
                completed += 1
                continue
            with self.cond:  # nothing agreed to send: wait for a new chunk here, then ask
                while not self.closing and not any(step.ready[c] and not sent[c] for c in range(n)):
                    self.cond.wait(0.5)
                if self.closing:
                    raise RuntimeError("closed during an exchange")
            self._complete(step, self._issue(step, -1), agreed)
        if self.grad_clip:
            self._update(step, done_params, clip=True)
        self._measure()

    def _measure(self) -> None:
        """Feed the estimator this step's busy periods: runs of payload messages each issued
        before the previous ones ended (their total time is the link's; single messages of a
        run overlap in the backend's threads)."""
        timeline, self.timeline = sorted(self.timeline), []
        start, end, nbytes, count = 0.0, -1.0, 0, 0
        for issued, done, size in [*timeline, (float("inf"), float("inf"), 0)]:
            if issued > end:
                if count:
                    self.estimator.add(nbytes, end - start, messages=count)
                start, end, nbytes, count = issued, done, 0, 0
            end = max(end, done)
            nbytes += size
            count += 1

    def _issue(self, step: _Step, chunk: int) -> _Op:
        n = len(self.layout)
        size = self.layout.sizes[chunk] if chunk >= 0 else 0
        param = self.params[0]
        buf = torch.empty(size + n, dtype=param.dtype, device=param.device)
        if chunk >= 0:
            scale = 1.0 / self.world
            for piece in self.layout.chunks[chunk]:
                grad = self.params[piece.param].grad
                out = buf[piece.offset : piece.offset + piece.length]
                if grad is None:
                    out.zero_()
                else:  # DDP's arithmetic: the gradient times 1/world into the bucket
                    torch.mul(
                        grad.reshape(-1)[piece.start : piece.start + piece.length], scale, out=out
                    )
        with self.cond:
            bitmap = list(step.ready)
        buf[size:] = torch.tensor(bitmap, dtype=buf.dtype)
        issued = time.perf_counter()
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        op = _Op(
            chunk=chunk,
            buf=buf,
            nbytes=buf.numel() * self.elem,
            issued=issued,
            work=work,
            clean=chunk >= 0,
        )
        work.get_future().add_done_callback(lambda _: op.done_at.append(time.perf_counter()))
        return op

    def _complete(self, step: _Step, op: _Op, agreed: list[bool]) -> list[int]:
        op.work.wait()
        done = op.done_at[0] if op.done_at else time.perf_counter()
        if op.clean:
            self.timeline.append((op.issued, done, op.nbytes))
        size = op.buf.numel() - len(self.layout)
        for c, count in enumerate(op.buf[size:].tolist()):
            if count == self.world:
                agreed[c] = True
        if op.chunk < 0:
            return []
        finished = []
        for piece in self.layout.chunks[op.chunk]:
            p = self.params[piece.param]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            p.grad.view(-1)[piece.start : piece.start + piece.length].copy_(
                op.buf[piece.offset : piece.offset + piece.length]
            )
            step.left[piece.param] -= 1
            if step.left[piece.param] == 0:
                finished.append(piece.param)
        if finished and not self.grad_clip:
            self._update(step, finished, clip=False)
        return finished

    def _update(self, step: _Step, indices: list[int], *, clip: bool) -> None:
        while not step.submitted.wait(0.5):
            if self.closing:
                raise RuntimeError("closed before submit()")
        if self.closing:
            raise RuntimeError("closed before submit()")
        optimizer = self.optimizer
        assert optimizer is not None
        if clip:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        ids = {id(self.params[i]) for i in indices}
        groups = []
        for group, hyper in zip(optimizer.param_groups, step.hyper, strict=True):
            mine = [p for p in group["params"] if id(p) in ids]
            if mine:
                groups.append({**hyper, "params": mine})
        if groups:
            view = type(optimizer).__new__(type(optimizer))  # same state, these parameters only
            view.__setstate__(
                {"defaults": optimizer.defaults, "state": optimizer.state, "param_groups": groups}
            )
            view.step()
        for i in indices:
            self.params[i].grad = None
            self.events[i].set()

    def _decide(self) -> None:
        """``auto``: rank 0 fits the link and every rank adopts its partition and credit."""
        link = self.link
        total = sum(p.numel() for p in self.params) * self.elem
        choice = torch.zeros(2, dtype=torch.float64)
        if self.main and link is not None:
            partition, credit = choose_partition(
                link, world_size=max(self.world, 2), total_bytes=total
            )
            choice[0] = partition if self.auto[0] else self.partition
            choice[1] = credit if self.auto[1] else self.credit
        dist.broadcast(choice, src=dist.get_global_rank(self.group, 0), group=self.group)
        if choice[0] <= 0:
            self.decisions.append("auto: no link estimate after 3 steps; kept the defaults")
        else:
            self.partition = int(choice[0])  # a fixed partition may not be the one the fit chose
            floor = 2 * self.partition if self.auto[1] else self.partition
            self.credit = max(int(choice[1]), floor)
            self.layout = self._layout()
            self.decisions.append(
                f"auto: link {link.bandwidth_mbit:.1f} Mbit/s, latency {link.alpha_s * 1e3:.2f} ms "
                f"-> partition {self.partition // 1024} KiB, credit {self.credit // 1024} KiB "
                f"({len(self.layout)} chunks)"
                if link is not None
                else f"auto: rank 0's link fit -> partition {self.partition // 1024} KiB, "
                f"credit {self.credit // 1024} KiB ({len(self.layout)} chunks)"
            )
        if self.main:
            self.log(f"comm schedule {self.decisions[-1]}")
