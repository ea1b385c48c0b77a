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

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.comm.bandwidth import BandwidthEstimator, LinkEstimate
from torsh_distributed.parallel._priority_exchange import Exchange
from torsh_distributed.parallel._priority_zero import ShardedExchange

__all__ = ["PriorityDataParallel"]


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
        probe: Measure the link's bandwidth with :func:`~torsh_distributed.comm.link_probe.
            probe_group_link` after step 3 (36 all-reduces on ``group`` from the exchange's
            thread, 0.1-0.5 s of link time, overlapping the next forward only); the per-message
            latency is then fitted on the exchange's own periods. ``False``: the passive fit
            alone (both from the periods; unreliable where the exchange is not link-bound).
        probe_every: Probe again every this many steps after the first (0 = once), to follow
            a link whose rate changes.
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
        probe: bool = True,
        probe_every: int = 0,
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
        if probe_every < 0:
            raise ValueError(f"probe_every must be >= 0 (0 = once), got {probe_every}")
        exchange = ShardedExchange if zero_stage == 2 else Exchange
        self._x = exchange(
            params,
            group=group,
            partition_bytes=partition_bytes,
            credit_bytes=credit_bytes,
            log=log,
            probe=probe,
            probe_every=probe_every,
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
        """``schedule``, ``partition_kb``, ``credit_kb``, ``bandwidth`` (the link: the probe's
        bandwidth and the fitted latency, ``source`` says which), ``achieved_mbit`` (what the
        exchange's periods got from the link), ``probes``, ``probe_seconds``, ``decisions``."""
        return self._x.summary()

    def close(self) -> None:
        """Stop the exchange thread (idempotent); removes the hooks."""
        self._x.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
