"""The priority exchange's state machine and thread (private; see :mod:`.priority`)."""

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
from torsh_distributed.comm.link_probe import probe_group_link
from torsh_distributed.parallel._chunks import ChunkLayout, plan_chunks

__all__ = ["AUTO_AFTER_STEPS", "DEFAULT_PARTITION", "Exchange", "Op", "Step"]

DEFAULT_PARTITION = 512 << 10
AUTO_AFTER_STEPS = 3
"""``auto``: steps of measurements before the partition and credit are chosen from the link."""


@dataclass(slots=True)
class Op:
    chunk: int  # -1: a bitmap-only message
    buf: torch.Tensor
    nbytes: int
    issued: float
    work: Any
    clean: bool  # a payload: its time is the link's (a bitmap-only one waits for backward)
    done_at: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Step:
    missing: list[int]  # per chunk: its parameters not yet ready here
    ready: list[bool]  # per chunk: every parameter's gradient is final here
    left: list[int]  # per parameter: its chunks not yet reduced
    submitted: threading.Event = field(default_factory=threading.Event)
    hyper: list[dict[str, Any]] = field(default_factory=list)


class Exchange:
    """The state machine and thread behind :class:`~.priority.PriorityDataParallel`."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        group: dist.ProcessGroup,
        partition_bytes: int,
        credit_bytes: int,
        log: Callable[[str], None],
        probe: bool = True,
        probe_every: int = 0,
    ) -> None:
        self.params, self.group, self.log = params, group, log
        self.probe, self.probe_every = probe, probe_every
        self.probed: LinkEstimate | None = None  # the last probe_group_link()
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
        self.step: Step | None = None
        self.steps = 0
        self.probes, self.probe_seconds = 0, 0.0
        self.cond = threading.Condition()
        self.idle = threading.Event()
        self.idle.set()
        self.error: BaseException | None = None
        self.closing = False
        self.timeline: list[tuple[float, float, int]] = []  # (issued, done, bytes) of payloads
        self.jobs: queue.SimpleQueue[Step | None] = queue.SimpleQueue()
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
            self.step = Step(
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
        achieved = self.estimator.achieved_bytes_s()
        return {
            "schedule": "priority",
            "zero_stage": 0,
            "partition_kb": self.partition // 1024,
            "credit_kb": self.credit // 1024,
            "chunks": len(self.layout),
            "bandwidth": link.to_dict() if link is not None else {},
            "achieved_mbit": round(achieved * 8 / 1e6, 3) if achieved else None,
            "probes": self.probes,
            "probe_seconds": round(self.probe_seconds, 3),
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
                self.steps += 1
                if self._probe_due():
                    self._probe()
                # here: the thread owns the samples
                if self.probed is None:
                    self.link = self.estimator.estimate()
                elif len(self.estimator):
                    self.link = self.estimator.estimate(
                        bandwidth_bytes_s=self.probed.bandwidth_bytes_s
                    )
                else:  # no period yet: the probe's own figures
                    self.link = self.probed
                if self.steps == AUTO_AFTER_STEPS and any(self.auto):
                    self._decide()
            except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
                self.error = exc
                for event in self.events:
                    event.set()
            finally:
                self.idle.set()

    def _probe_due(self) -> bool:
        """After step 3 (before ``auto`` decides) and every ``probe_every`` steps after it: the
        same steps on every rank, so every rank's thread issues the probe at the same point of
        the group's order of collectives."""
        if not self.probe or self.world < 2 or self.steps < AUTO_AFTER_STEPS:
            return False
        after = self.steps - AUTO_AFTER_STEPS
        return after == 0 or (self.probe_every > 0 and after % self.probe_every == 0)

    def _probe(self) -> None:
        start = time.perf_counter()
        try:
            self.probed = probe_group_link(self.group, device=self.params[0].device)
        except RuntimeError as exc:  # its own check, raised on every rank after the same ops
            self.decisions.append(f"probe after step {self.steps} failed ({exc}): passive fit")
            return
        took = time.perf_counter() - start
        self.probe_seconds += took
        if self.probes < 3:  # the first ones; later probes are in the summary
            self.decisions.append(
                f"probe after step {self.steps}: link {self.probed.bandwidth_mbit:.1f} Mbit/s "
                f"({took:.2f} s)"
            )
        self.probes += 1

    def _exchange(self, step: Step) -> None:
        layout, n = self.layout, len(self.layout)
        sent, agreed = [False] * n, [False] * n
        inflight: deque[Op] = deque()
        inflight_bytes, completed, done_params = 0, 0, []
        pending: list[int] = []  # reduced, not yet updated: the step's lr is known at submit()
        while completed < n:
            if pending and step.submitted.is_set():
                self._update(step, pending, clip=False)
                pending = []
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
                finished = self._complete(step, op, agreed)
                (done_params if self.grad_clip else pending).extend(finished)
                completed += 1
                continue
            with self.cond:  # nothing agreed to send: wait for a new chunk here, then ask
                while not self.closing and not any(step.ready[c] and not sent[c] for c in range(n)):
                    self.cond.wait(0.5)
                if self.closing:
                    raise RuntimeError("closed during an exchange")
            self._complete(step, self._issue(step, -1), agreed)
        if pending:  # waits for submit(): backward may still be running
            self._update(step, pending, clip=False)
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

    def _issue(self, step: Step, chunk: int) -> Op:
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
        op = Op(
            chunk=chunk,
            buf=buf,
            nbytes=buf.numel() * self.elem,
            issued=issued,
            work=work,
            clean=chunk >= 0,
        )
        work.get_future().add_done_callback(lambda _: op.done_at.append(time.perf_counter()))
        return op

    def _complete(self, step: Step, op: Op, agreed: list[bool]) -> list[int]:
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
        return finished

    def _update(self, step: Step, indices: list[int], *, clip: bool) -> None:
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
