"""The ``gloo+shm`` process group: shared memory inside a node, Gloo between nodes.

A Python :class:`torch.distributed.ProcessGroup` (torch calls its methods for ``dist.all_reduce``
and friends, and DDP's reducer calls them from C++). It owns a Gloo group over all its ranks,
registered as its CPU backend, for every operation it does not take itself (point-to-point,
all-to-all, gather/scatter, reduce, unusual dtypes or layouts) and for torch's internal C++
helpers, so everything torch can do on Gloo keeps working.

Ranks are grouped into nodes by ``TORSH_NODE_ASSIGNMENT`` (simulated hosts) or by what makes
shared memory shared: boot id, network namespace and the ``/dev/shm`` file system. On one node
every supported collective goes through the node's :class:`ShmTransport`. On several nodes
every one of them is hierarchical (shm inside each node, Gloo between the node leaders, shm
broadcast inside); all-gather and reduce-scatter only when every node has as many ranks (else
Gloo). The shared-memory operations run in call order on the group's progress queue
(``_shm_async``): with ``async_op=True`` (DDP's bucket all-reduces) on its thread while the
caller computes, with ``async_op=False`` in the calling thread when nothing is queued before them.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, PrefixStore, ProcessGroup

from torsh_distributed.runtime._shm_async import Job, Progress, ShmWork
from torsh_distributed.runtime._shm_segment import Segment, cleanup_stale_segments, new_name
from torsh_distributed.runtime._shm_sync import load_flags
from torsh_distributed.runtime._shm_transport import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_PHASES,
    ShmTransport,
    segment_bytes,
    supports,
)
from torsh_distributed.runtime.errors import DistributedTimeoutError, FeatureNotAvailableError

__all__ = ["BACKEND_NAME", "ShmProcessGroup", "create", "node_key", "set_lenient"]

BACKEND_NAME = "gloo+shm"
DEFAULT_SLOT_BYTES = 1 << 20
"""Slot size unless ``TORSH_SHM_SLOT_BYTES`` says otherwise (the C kernels' chunks: 256 KiB, in a
third of it). Larger slots with fewer, larger chunks were measured and lost, quiet and beside
CPU-burning neighbours alike, once waits stopped yielding (docs/benchmarks.md). A group's segment
takes at most a quarter of the free ``/dev/shm`` (the slot shrinks to fit, to 1 MiB at least)."""
MIN_FITTED_SLOT_BYTES = 1 << 20
log = logging.getLogger(__name__)
_lenient = False


def set_lenient(value: bool) -> None:
    """``True`` (``backend="auto"`` chose this backend): a group whose segment cannot be made
    (``/dev/shm`` too small or missing) runs every operation on Gloo with a warning instead of
    failing. ``False`` (the default, ``backend="gloo+shm"`` asked for by name): it fails."""
    global _lenient
    _lenient = value


_RED = dist.ReduceOp.RedOpType
_OPS = {
    _RED.SUM: "sum",
    _RED.AVG: "avg",
    _RED.PRODUCT: "product",
    _RED.MIN: "min",
    _RED.MAX: "max",
}


def _op_name(opts: Any) -> str | None:
    red = opts.reduceOp
    return _OPS.get(getattr(red, "op", red))


def node_key(global_rank: int) -> str:
    """What must match for two ranks to share memory (or the simulated host's id)."""
    assignment = os.environ.get("TORSH_NODE_ASSIGNMENT")
    if assignment:
        nodes = [x.strip() for x in assignment.split(",")]
        if global_rank < len(nodes):
            return f"assigned:{nodes[global_rank]}"
    boot = Path("/proc/sys/kernel/random/boot_id")
    parts = [boot.read_text().strip() if boot.exists() else os.uname().nodename]
    for probe in ("/proc/self/ns/net", "/dev/shm"):
        try:
            st = os.stat(probe)
            parts.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            parts.append("-")
    return "|".join(parts)


def _wait_count(store: dist.Store, key: str, want: int, timeout_s: float, rank: int) -> None:
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < want:
        if time.monotonic() >= deadline:
            raise DistributedTimeoutError(
                f"only {store.add(key, 0)} of {want} ranks of the node attached the shared-memory "
                f"segment within {timeout_s:g} s",
                rank=rank,
                operation="gloo+shm init",
                fix="check that every rank of the node started.",
            )
        time.sleep(0.002)


class ShmProcessGroup(ProcessGroup):
    """See the module docstring. Built by :func:`create` (torch's backend hook)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        global_ranks: Sequence[int],
        *,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_phases: int = DEFAULT_MAX_PHASES,
        fit_slot: bool = False,
        asynchronous: bool = True,
    ) -> None:
        super().__init__(rank, size)
        self.progress = Progress(rank=rank, name=f"{rank}of{size}", asynchronous=asynchronous)
        """The group's queue of shared-memory operations (``progress.asynchronous``: whether
        ``async_op=True`` calls run on its thread; ``progress.busy_s``: their seconds)."""
        self._max_phases = max_phases
        self._fit_slot = fit_slot
        self.counts: Counter[str] = Counter()
        """Calls per path (``"shm allreduce"``, ``"gloo alltoall"``, ...): what took the fast path."""
        self._timeout_s = timeout.total_seconds()
        self._gloo = dist.ProcessGroupGloo(PrefixStore("gloo", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, self._gloo)
        shm_store = PrefixStore("shm", store)
        shm_store.set(f"node/{rank}", node_key(global_ranks[rank]))
        keys = [shm_store.get(f"node/{r}").decode() for r in range(size)]
        nodes: dict[str, list[int]] = {}
        for r, key in enumerate(keys):
            nodes.setdefault(key, []).append(r)
        groups = list(nodes.values())  # ordered by their first rank
        self._local = nodes[keys[rank]]
        self._local_rank = self._local.index(rank)
        self._leaders = [g[0] for g in groups]
        self._node_index = self._leaders.index(self._local[0])
        self._node_of = {r: i for i, g in enumerate(groups) for r in g}
        self._groups = groups
        self.num_nodes = len(groups)
        # all-gather and reduce-scatter go node by node only when every node has as many ranks
        # (Gloo's collectives between the leaders need equal sizes)
        self._even_nodes = len({len(g) for g in groups}) == 1
        self._transport = self._attach(shm_store, slot_bytes, chunk_bytes, global_ranks)
        if _lenient and not self._everyone_has_memory(shm_store, self._transport is not None):
            if self._transport is not None:
                self._transport.close()
            self._transport = None
        self._leader_pg: dist.ProcessGroup | None = None
        if self.num_nodes > 1 and self._local_rank == 0:
            self._leader_pg = dist.ProcessGroupGloo(
                PrefixStore("leaders", store), self._node_index, self.num_nodes, timeout
            )
        log.debug(
            "gloo+shm rank %d: node %d of %d, %d local ranks",
            rank,
            self._node_index,
            self.num_nodes,
            len(self._local),
        )

    def _attach(
        self, store: dist.Store, slot_bytes: int, chunk_bytes: int, global_ranks: Sequence[int]
    ) -> ShmTransport | None:
        lib = load_flags()
        num = len(self._local)
        leader = self._local[0]
        key = f"segment/{leader}"
        if self._local_rank == 0:
            cleanup_stale_segments()
            if self._fit_slot:
                slot_bytes = fitted_slot(slot_bytes, num)
            size = segment_bytes(num, slot_bytes)
            try:
                segment = Segment.create(new_name(), size=size, num_ranks=num)
            except OSError as exc:
                if _lenient:
                    log.warning(
                        "gloo+shm (chosen by backend='auto'): cannot create a %d B segment in "
                        "/dev/shm (%s): this group runs on Gloo; mount a larger /dev/shm "
                        "(docker: --shm-size) for the shared-memory path",
                        size,
                        exc,
                    )
                    store.set(key, "")
                    return None
                raise FeatureNotAvailableError(
                    f"cannot create a {size} B shared-memory segment in /dev/shm: {exc}",
                    rank=self.rank(),
                    operation="gloo+shm init",
                    fix="mount /dev/shm with enough space (docker: --shm-size), or use 'gloo'.",
                ) from exc
            store.set(key, f"{segment.name}:{slot_bytes}")
        else:
            published = store.get(key).decode()
            if not published:  # the node's first rank could not make it (lenient mode)
                return None
            name, _, slot_text = published.rpartition(":")
            slot_bytes = int(slot_text)  # the first rank's (fitted) slot
            segment = Segment.attach(name, size=segment_bytes(num, slot_bytes), num_ranks=num)
        segment.set_pid(self._local_rank, os.getpid())
        store.add(f"{key}/attached", 1)
        if self._local_rank == 0:
            try:
                _wait_count(store, f"{key}/attached", num, self._timeout_s, self.rank())
            finally:
                segment.unlink()  # from here on no exit path can leave it in /dev/shm
        return ShmTransport(
            segment,
            local_rank=self._local_rank,
            global_ranks=[global_ranks[r] for r in self._local],
            slot_bytes=slot_bytes,
            chunk_bytes=chunk_bytes,
            max_phases=self._max_phases,
            timeout_s=self._timeout_s,
            lib=lib,
        )

    def _everyone_has_memory(self, store: dist.Store, mine: bool) -> bool:
        """Whether every rank (every node) has its segment: the shared-memory paths need all."""
        store.add("vote/ok", int(mine))  # before the count: a full count means every vote is in
        store.add("vote/n", 1)
        _wait_count(store, "vote/n", self.size(), self._timeout_s, self.rank())
        return store.add("vote/ok", 0) == self.size()

    @property
    def _shm(self) -> ShmTransport:
        assert self._transport is not None  # the callers checked _takes
        return self._transport

    def _takes(self, tensor: torch.Tensor, op: str | None = None) -> bool:
        return self._transport is not None and supports(tensor, op)

    def _fallback(self, name: str) -> Any:
        self.counts[f"gloo {name}"] += 1
        return getattr(self._gloo, name)

    # -- torch's ProcessGroup interface ------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    @property
    def single_node(self) -> bool:
        return self.num_nodes == 1

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        op = _op_name(opts)
        if len(tensors) != 1 or op is None or not self._takes(tensors[0], op):
            return self._fallback("allreduce")(tensors, opts)
        tensor = tensors[0]
        self.counts["shm allreduce"] += 1
        return self._submit(
            f"all_reduce({op})", lambda: self._all_reduce(tensor, op), tensors, opts
        )

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        if self.single_node:
            self._shm.all_reduce(tensor, op)
            return
        local_op = "sum" if op == "avg" else op
        self._shm.all_reduce(tensor, local_op)
        if self._leader_pg is not None:
            outer = dist.AllreduceOptions()
            outer.reduceOp = getattr(dist.ReduceOp, local_op.upper())
            self._leader_pg.allreduce([tensor], outer).wait()
            if op == "avg":
                tensor.div_(self.size())
        self._shm.broadcast(tensor, 0)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        if len(tensors) != 1 or not self._takes(tensors[0]):
            return self._fallback("broadcast")(tensors, opts)
        tensor, root = tensors[0], opts.rootRank
        self.counts["shm broadcast"] += 1
        return self._submit("broadcast", lambda: self._broadcast(tensor, root), tensors, opts)

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        root_node = self._node_of[root]
        if root_node == self._node_index:
            self._shm.broadcast(tensor, self._local.index(root))
        if self._leader_pg is not None:
            outer = dist.BroadcastOptions()
            outer.rootRank = root_node
            self._leader_pg.broadcast([tensor], outer).wait()
        if root_node != self._node_index:
            self._shm.broadcast(tensor, 0)

    def barrier(self, opts: Any = None) -> dist.Work:
        if self._transport is None:
            return self._fallback("barrier")(opts if opts is not None else dist.BarrierOptions())
        self.counts["shm barrier"] += 1
        return self._submit("barrier", self._barrier, [], opts)

    def _barrier(self) -> None:
        self._shm.barrier()
        if self._leader_pg is not None:
            self._leader_pg.barrier().wait()
        if not self.single_node:
            self._shm.barrier()

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        if (
            not self._even_nodes
            or not (self._takes(input) and self._takes(output))
            or output.numel() != input.numel() * self.size()
            or output.dtype != input.dtype
        ):
            return self._fallback("_allgather_base")(output, input, opts)
        self.counts["shm _allgather_base"] += 1
        return self._submit("all_gather", lambda: self._all_gather(output, input), [output], opts)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if self.single_node:
            self._shm.all_gather(output, input)
        else:
            self._hierarchical_all_gather(output.view(self.size(), -1), input.reshape(-1))

    def _hierarchical_all_gather(self, out: torch.Tensor, input: torch.Tensor) -> None:
        """shm all-gather in the node, Gloo all-gather of the node blocks between leaders, shm
        broadcast of the whole result in the node."""
        local = torch.empty((len(self._local), input.numel()), dtype=input.dtype)
        self._shm.all_gather(local, input)
        if self._leader_pg is not None:
            blocks = [torch.empty_like(local) for _ in range(self.num_nodes)]
            self._leader_pg.allgather([blocks], [local], AllgatherOptions()).wait()
            for group, block in zip(self._groups, blocks, strict=True):
                out[group] = block  # rows to their global ranks
        self._shm.broadcast(out, 0)

    def _hierarchical_reduce_scatter(self, out: torch.Tensor, input: torch.Tensor, op: str) -> None:
        """shm all-reduce of the input in the node, Gloo reduce-scatter of the node sums between
        leaders (each leader gets its node's rows), shm broadcast of those rows in the node."""
        local_op = "sum" if op == "avg" else op
        total = input.reshape(self.size(), -1).clone()
        self._shm.all_reduce(total, local_op)
        rows = torch.empty((len(self._local), out.numel()), dtype=out.dtype)
        if self._leader_pg is not None:
            by_node = torch.cat([total[g] for g in self._groups])  # node-major row order
            outer = dist.ReduceScatterOptions()
            outer.reduceOp = getattr(dist.ReduceOp, local_op.upper())
            self._leader_pg._reduce_scatter_base(rows, by_node, outer).wait()
            if op == "avg":
                rows.div_(self.size())
        self._shm.broadcast(rows, 0)
        out.view(-1).copy_(rows[self._local_rank])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        return self._allgather_base(output, input, opts)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        if not self._even_nodes or len(inputs) != 1 or not self._takes(inputs[0]):
            return self._fallback("allgather")(outputs, inputs, opts)
        if any(o.shape != inputs[0].shape or o.dtype != inputs[0].dtype for o in outputs[0]):
            return self._fallback("allgather")(outputs, inputs, opts)
        self.counts["shm allgather"] += 1
        source, targets = inputs[0], outputs[0]

        def job() -> None:
            flat = torch.empty((self.size(), source.numel()), dtype=source.dtype)
            self._all_gather(flat, source)
            for j, out in enumerate(targets):
                out.copy_(flat[j].view(out.shape))  # outputs may be strided views

        return self._submit("all_gather", job, targets, opts)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any
    ) -> dist.Work:
        op = _op_name(opts)
        if (
            not self._even_nodes
            or op is None
            or not (self._takes(input, op) and self._takes(output, op))
            or input.numel() != output.numel() * self.size()
            or output.dtype != input.dtype
        ):
            return self._fallback("_reduce_scatter_base")(output, input, opts)
        self.counts["shm _reduce_scatter_base"] += 1
        return self._submit(
            f"reduce_scatter({op})", lambda: self._reduce_scatter(output, input, op), [output], opts
        )

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
        if self.single_node:
            self._shm.reduce_scatter(output, input, op)
        else:
            self._hierarchical_reduce_scatter(output, input, op)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any
    ) -> dist.Work:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> dist.Work:
        op = _op_name(opts)
        out = outputs[0] if len(outputs) == 1 else None
        if (
            out is None
            or not self._even_nodes
            or op is None
            or not self._takes(out, op)
            or any(t.shape != out.shape or t.dtype != out.dtype for t in inputs[0])
        ):
            return self._fallback("reduce_scatter")(outputs, inputs, opts)
        self.counts["shm reduce_scatter"] += 1
        parts = inputs[0]

        def job() -> None:
            self._reduce_scatter(out, torch.stack([t.reshape(-1) for t in parts]), op)

        return self._submit(f"reduce_scatter({op})", job, outputs, opts)

    # -- operations Gloo does ------------------------------------------------------------------
    # torch's C++ trampoline for a Python process group holds the GIL while it looks for these
    # methods and, when they are missing, calls the C++ base with the GIL still held. A Gloo
    # worker that frees a finished work drops its tensors' Python objects (needs the GIL) while
    # holding the queue lock such a call waits for: a deadlock (seen with all_to_all_single in
    # Horovod's alltoall backward, 1 run in 3). Defined here, they reach Gloo through its Python
    # binding, which releases the GIL.

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any,
    ) -> dist.Work:
        return self._fallback("alltoall_base")(
            output, input, output_split_sizes, input_split_sizes, opts
        )

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._fallback("send")(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._fallback("recv")(tensors, src, tag)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._fallback("allreduce_coalesced")(tensors, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        works = [
            self._allgather_base(out, inp, opts) for out, inp in zip(outputs, inputs, strict=True)
        ]
        return self._coalesced("all_gather", works, outputs, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        works = [
            self._reduce_scatter_base(out, inp, opts)
            for out, inp in zip(outputs, inputs, strict=True)
        ]
        return self._coalesced("reduce_scatter", works, outputs, opts)

    def _submit(self, op: str, job: Job, result: list[torch.Tensor], opts: Any) -> ShmWork:
        """Queue ``job`` behind the group's earlier shared-memory operations (see ``_shm_async``)."""
        work = ShmWork(result, rank=self.rank(), operation=op)
        return self.progress.submit(job, work, caller_waits=not getattr(opts, "asyncOp", True))

    def _coalesced(
        self, op: str, works: list[dist.Work], outputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        """One work for the parts of a coalesced call, queued after them: done when they are,
        failed with the first part's error (a part Gloo took is waited for too)."""

        def job() -> None:
            for w in works:
                w.wait()

        return self._submit(f"{op} (coalesced)", job, outputs, opts)

    def shutdown(self) -> None:
        if self._transport is not None:
            self._transport.cancel()  # a job waiting for a peer gives up within 0.25 s
        if not self.progress.close(join_s=max(self._timeout_s, 5.0)):
            # still inside a kernel (a very loaded host): unmapping under it would crash it;
            # the mapping goes with the process (the name was unlinked at init)
            log.warning("gloo+shm rank %d: progress thread still busy at shutdown", self.rank())
            return
        if self._transport is not None:
            self._transport.close()


def fitted_slot(slot_bytes: int, num_ranks: int, directory: str = "/dev/shm") -> int:
    """``slot_bytes``, shrunk so that a segment of ``num_ranks`` ranks takes at most a quarter of
    the free space of ``directory`` (a multiple of 4096, at least ``MIN_FITTED_SLOT_BYTES``, and
    never above ``slot_bytes``); ``slot_bytes`` where the free space cannot be read."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return slot_bytes
    free = st.f_bavail * st.f_frsize
    fit = free // 4 // (2 * num_ranks) // 4096 * 4096
    return max(min(slot_bytes, fit), min(slot_bytes, MIN_FITTED_SLOT_BYTES))


def create(backend_opts: Any, pg_options: Any) -> ShmProcessGroup:
    """torch's creator hook (``register_backend(..., extended_api=True)``)."""
    text = os.environ.get("TORSH_SHM_SLOT_BYTES", str(DEFAULT_SLOT_BYTES))
    slot = int(text) if text.strip().isdigit() else 0
    if slot < 4096 or slot % 4096:
        raise ValueError(f"TORSH_SHM_SLOT_BYTES must be a positive multiple of 4096, got {text!r}")
    text = os.environ.get("TORSH_SHM_CHUNK_BYTES", str(DEFAULT_CHUNK_BYTES))
    chunk = int(text) if text.strip().isdigit() else 0
    if chunk < 64 or chunk % 64:
        raise ValueError(f"TORSH_SHM_CHUNK_BYTES must be a positive multiple of 64, got {text!r}")
    text = os.environ.get("TORSH_SHM_MAX_PHASES", str(DEFAULT_MAX_PHASES))
    phases = int(text) if text.strip().isdigit() else 0
    if phases < 1:
        raise ValueError(f"TORSH_SHM_MAX_PHASES must be a positive integer, got {text!r}")
    text = os.environ.get("TORSH_SHM_ASYNC", "1")
    if text.strip() not in ("0", "1"):
        raise ValueError(f"TORSH_SHM_ASYNC must be 0 or 1, got {text!r}")
    ranks = list(backend_opts.global_ranks_in_group) or list(range(backend_opts.group_size))
    return ShmProcessGroup(
        backend_opts.store,
        backend_opts.group_rank,
        backend_opts.group_size,
        backend_opts.timeout,
        ranks,
        slot_bytes=slot,
        chunk_bytes=chunk,
        max_phases=phases,
        fit_slot="TORSH_SHM_SLOT_BYTES" not in os.environ,  # a slot asked for is used as asked
        asynchronous=text.strip() == "1",
    )
