"""The collectives facade: torch.distributed's operations with our reduce ops, algorithms,
profiling and hang diagnosis.

Every function mirrors its ``torch.distributed`` namesake (ranks are global, ``group=None`` is the
world) and adds:

- ``op`` takes :class:`~torsh_distributed.comm.reduce_op.ReduceOp` (``MEAN`` works on Gloo);
- ``algorithm=`` on all-reduce / broadcast / reduce: ``"torch"`` (the backend's own, default),
  ``"ring"``, ``"tree"``, ``"hierarchical"`` (needs :class:`~torsh_distributed.comm.dims.ParallelDims`
  with several nodes) or ``"auto"`` (alpha-beta cost model);
- ``async_op=True`` returns a :class:`Work` whose ``wait()`` also finishes emulated MEAN; our own
  algorithms run eagerly and return a completed :class:`Work`;
- records into :mod:`~torsh_distributed.comm.profiler` when enabled and fingerprints into the store
  when :mod:`~torsh_distributed.comm.debug` is enabled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.comm import profiler as _profiler
from torsh_distributed.comm._facade import (
    Work,
    _hier_groups,
    _mean_finisher,
    _native_avg,
    _nbytes,
    _run,
    _shape,
    _size,
    default_cost_model,
    plain,
    reraise,
    resolve_algorithm,
)
from torsh_distributed.comm._hot import HOT as _HOT
from torsh_distributed.comm.algorithms import (
    ALGORITHMS,
    bucketed_all_reduce,
    hierarchical_all_reduce,
    ring_all_reduce,
    tree_all_reduce,
    tree_broadcast,
    tree_reduce,
)
from torsh_distributed.comm.algorithms._p2p import members
from torsh_distributed.comm.dims import group_name
from torsh_distributed.comm.reduce_op import ReduceOp, check_dtype, finish_mean_

__all__ = [
    "ALGORITHMS",
    "ReduceOp",
    "Work",
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "batch_isend_irecv",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "resolve_algorithm",
    "default_cost_model",
]

P2POp = dist.P2POp
# torch >= 2.10 names them *_single (the *_tensor names warn there)
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- reductions ---------------------------------------------------------------------------------
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    algorithm: str = "torch",
) -> Work | None:
    """Reduce ``tensor`` across ``group`` in place on every rank."""
    if op is ReduceOp.SUM and algorithm == "torch" and (_HOT[0] or plain()):
        try:
            handle = dist.all_reduce(tensor, group=group, async_op=async_op)
        except RuntimeError as exc:
            reraise(exc, "all_reduce", group)
        return Work(handle) if async_op else None
    rop = ReduceOp.parse(op)
    check_dtype(rop, tensor.dtype)
    algo = resolve_algorithm(algorithm, "all_reduce", _nbytes(tensor), group)
    n = _size(group) if rop is ReduceOp.MEAN or algo == "hierarchical" else 0
    native = _native_avg(group)
    finish = None
    if algo == "torch":

        def body() -> Any:
            return dist.all_reduce(
                tensor, op=rop.to_torch(native_avg=native), group=group, async_op=async_op
            )

        if rop is ReduceOp.MEAN and not native:

            def finish() -> None:
                finish_mean_(tensor, rop, n)
    elif algo == "ring":

        def body() -> Any:
            return ring_all_reduce(tensor, rop, group)
    elif algo == "tree":

        def body() -> Any:
            return tree_all_reduce(tensor, rop, group)
    else:
        intra, inter = _hier_groups(group)  # type: ignore[misc]

        def body() -> Any:
            return hierarchical_all_reduce(
                tensor,
                rop,
                intra_group=intra,
                inter_group=inter,
                world_count=n,
                inter_native=os.environ.get("TORSH_HIERARCHICAL_INTER", "torch") == "torch",
            )

    return _run(
        "all_reduce",
        body,
        group=group,
        nbytes=_nbytes(tensor),
        algorithm=algo,
        shape=_shape(tensor),
        dtype=tensor.dtype,
        detail=f"op={rop.name}",
        finish=finish,
        async_op=async_op,
    )


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    group: dist.ProcessGroup | None = None,
    algorithm: str = "torch",
    bucket_bytes: int = 4 << 20,
) -> list[torch.Tensor]:
    """All-reduce many (small) tensors in place, packed into buckets of ``bucket_bytes``."""
    rop = ReduceOp.parse(op)
    for t in tensors:
        check_dtype(rop, t.dtype)
    return bucketed_all_reduce(
        tensors,
        lambda flat: all_reduce(flat, rop, group=group, algorithm=algorithm),
        bucket_bytes=bucket_bytes,
    )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    algorithm: str = "torch",
) -> Work | None:
    """Copy ``tensor`` of global rank ``src`` to every rank of ``group``."""
    if algorithm == "torch" and (_HOT[0] or plain()):
        try:
            handle = dist.broadcast(tensor, src, group=group, async_op=async_op)
        except RuntimeError as exc:
            reraise(exc, "broadcast", group)
        return Work(handle) if async_op else None
    algo = resolve_algorithm(algorithm, "broadcast", _nbytes(tensor), group)
    if algo in ("ring", "hierarchical"):
        algo = "tree"  # a pipelined ring broadcast is not implemented: the tree is our p2p one
    if algo == "tree":

        def body() -> Any:
            return tree_broadcast(tensor, members(group).index(src), group)
    else:

        def body() -> Any:
            return dist.broadcast(tensor, src, group=group, async_op=async_op)

    return _run(
        "broadcast",
        body,
        group=group,
        nbytes=_nbytes(tensor),
        algorithm=algo,
        shape=_shape(tensor),
        dtype=tensor.dtype,
        detail=f"src={src}",
        async_op=async_op,
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    algorithm: str = "torch",
) -> Work | None:
    """Reduce ``tensor`` of every rank into ``tensor`` on global rank ``dst``."""
    if op is ReduceOp.SUM and algorithm == "torch" and (_HOT[0] or plain()):
        try:
            handle = dist.reduce(tensor, dst, group=group, async_op=async_op)
        except RuntimeError as exc:
            reraise(exc, "reduce", group)
        return Work(handle) if async_op else None
    rop = ReduceOp.parse(op)
    check_dtype(rop, tensor.dtype)
    algo = resolve_algorithm(algorithm, "reduce", _nbytes(tensor), group)
    if algo in ("ring", "hierarchical"):
        algo = "tree"
    native = _native_avg(group)
    finish = None
    if algo == "tree":

        def body() -> Any:
            return tree_reduce(tensor, members(group).index(dst), rop, group)
    else:

        def body() -> Any:
            return dist.reduce(
                tensor, dst, op=rop.to_torch(native_avg=native), group=group, async_op=async_op
            )

        if rop is ReduceOp.MEAN and not native and dist.get_rank() == dst:

            def finish() -> None:
                finish_mean_(tensor, rop, _size(group))

    return _run(
        "reduce",
        body,
        group=group,
        nbytes=_nbytes(tensor),
        algorithm=algo,
        shape=_shape(tensor),
        dtype=tensor.dtype,
        detail=f"op={rop.name}, dst={dst}",
        finish=finish,
        async_op=async_op,
    )


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input_list[i]`` across ranks into ``output`` of group rank ``i``."""
    rop = ReduceOp.parse(op)
    check_dtype(rop, output.dtype)
    native = _native_avg(group)
    finish = _mean_finisher(output, rop, group, native)
    return _run(
        "reduce_scatter",
        lambda: dist.reduce_scatter(
            output, input_list, op=rop.to_torch(native_avg=native), group=group, async_op=async_op
        ),
        group=group,
        nbytes=sum(_nbytes(t) for t in input_list),
        shape=_shape(output),
        dtype=output.dtype,
        detail=f"op={rop.name}",
        finish=finish,
        async_op=async_op,
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Like :func:`reduce_scatter` with ``input`` the concatenation of the per-rank inputs."""
    fn = _REDUCE_SCATTER_SINGLE
    if op is ReduceOp.SUM and (_HOT[0] or plain()):
        try:
            handle = fn(output, input, group=group, async_op=async_op)
        except RuntimeError as exc:
            reraise(exc, "reduce_scatter_tensor", group)
        return Work(handle) if async_op else None
    rop = ReduceOp.parse(op)
    check_dtype(rop, output.dtype)
    native = _native_avg(group)
    finish = _mean_finisher(output, rop, group, native)
    return _run(
        "reduce_scatter_tensor",
        lambda: fn(
            output, input, op=rop.to_torch(native_avg=native), group=group, async_op=async_op
        ),
        group=group,
        nbytes=_nbytes(input),
        shape=_shape(output),
        dtype=output.dtype,
        detail=f"op={rop.name}",
        finish=finish,
        async_op=async_op,
    )


# -- data movement ------------------------------------------------------------------------------
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Gather ``tensor`` of every rank into ``tensor_list`` on every rank."""
    if _HOT[0] or plain():
        try:
            handle = dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        except RuntimeError as exc:
            reraise(exc, "all_gather", group)
        return Work(handle) if async_op else None
    return _run(
        "all_gather",
        lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op),
        group=group,
        nbytes=sum(_nbytes(t) for t in tensor_list),
        shape=_shape(tensor),
        dtype=tensor.dtype,
        async_op=async_op,
    )


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Gather ``input`` of every rank, concatenated along dim 0, into ``output``."""
    fn = _ALL_GATHER_SINGLE
    if _HOT[0] or plain():
        try:
            handle = fn(output, input, group=group, async_op=async_op)
        except RuntimeError as exc:
            reraise(exc, "all_gather_into_tensor", group)
        return Work(handle) if async_op else None
    return _run(
        "all_gather_into_tensor",
        lambda: fn(output, input, group=group, async_op=async_op),
        group=group,
        nbytes=_nbytes(output),
        shape=_shape(input),
        dtype=input.dtype,
        async_op=async_op,
    )


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Gather ``tensor`` of every rank into ``gather_list`` on global rank ``dst``."""
    return _run(
        "gather",
        lambda: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op),
        group=group,
        nbytes=_nbytes(tensor) * _size(group),
        shape=_shape(tensor),
        dtype=tensor.dtype,
        detail=f"dst={dst}",
        async_op=async_op,
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Send ``scatter_list[i]`` of global rank ``src`` to group rank ``i``'s ``tensor``."""
    return _run(
        "scatter",
        lambda: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op),
        group=group,
        nbytes=_nbytes(tensor) * _size(group),
        shape=_shape(tensor),
        dtype=tensor.dtype,
        detail=f"src={src}",
        async_op=async_op,
    )


def all_to_all(
    output_list: list[torch.Tensor],
    input_list: list[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Send ``input_list[i]`` to group rank ``i``; receive into ``output_list[j]`` from rank ``j``."""
    return _run(
        "all_to_all",
        lambda: dist.all_to_all(output_list, input_list, group=group, async_op=async_op),
        group=group,
        nbytes=sum(_nbytes(t) for t in input_list),
        dtype=input_list[0].dtype if input_list else None,
        async_op=async_op,
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """All-to-all of one tensor split along dim 0 (evenly, or by the given split sizes)."""
    if _HOT[0] or plain():
        try:
            handle = dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
            )
        except RuntimeError as exc:
            reraise(exc, "all_to_all_single", group)
        return Work(handle) if async_op else None
    even = output_split_sizes is None and input_split_sizes is None
    return _run(
        "all_to_all_single",
        lambda: dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        ),
        group=group,
        nbytes=_nbytes(input),
        shape=_shape(input) if even else None,
        dtype=input.dtype,
        async_op=async_op,
    )


def barrier(*, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Block until every rank of ``group`` arrives."""
    return _run(
        "barrier",
        lambda: dist.barrier(group=group, async_op=async_op),
        group=group,
        nbytes=0,
        async_op=async_op,
    )


# -- point to point (not fingerprinted: peers, not groups, must agree) ----------------------------
def _p2p(name: str, fn: Callable[[], Any], tensor: torch.Tensor, group: Any) -> Any:
    prof = _profiler.active()
    start = prof.now_us() if prof is not None else 0.0
    out = fn()
    if prof is not None:
        prof.record(name, _nbytes(tensor), group_name(group), 2, "torch", start)
    return out


def send(
    tensor: torch.Tensor, dst: int, *, group: dist.ProcessGroup | None = None, tag: int = 0
) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    _p2p("send", lambda: dist.send(tensor, dst, group=group, tag=tag), tensor, group)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any when ``None``); returns the sender."""
    return int(_p2p("recv", lambda: dist.recv(tensor, src, group=group, tag=tag), tensor, group))


def isend(
    tensor: torch.Tensor, dst: int, *, group: dist.ProcessGroup | None = None, tag: int = 0
) -> Work:
    """Start sending ``tensor`` to ``dst``; ``wait()`` on the result."""
    return Work(dist.isend(tensor, dst, group=group, tag=tag))


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
) -> Work:
    """Start receiving into ``tensor``; ``wait()`` on the result."""
    return Work(dist.irecv(tensor, src, group=group, tag=tag))


def batch_isend_irecv(ops: list[dist.P2POp]) -> list[Work]:
    """Post several sends/receives at once (``P2POp(isend|irecv, tensor, peer)``)."""
    return [Work(w) for w in dist.batch_isend_irecv(ops)]


# -- object collectives (pickle: only between ranks of one job, never untrusted peers) -------------
def broadcast_object_list(
    objects: list[Any], src: int = 0, *, group: dist.ProcessGroup | None = None
) -> None:
    """Broadcast picklable ``objects`` from global rank ``src``, in place."""
    _run(
        "broadcast_object_list",
        lambda: dist.broadcast_object_list(objects, src, group=group),
        group=group,
        nbytes=0,
        detail=f"src={src}, n={len(objects)}",
    )


def all_gather_object(
    output: list[Any], obj: Any, *, group: dist.ProcessGroup | None = None
) -> None:
    """Gather a picklable ``obj`` from every rank into ``output``."""
    _run(
        "all_gather_object",
        lambda: dist.all_gather_object(output, obj, group=group),
        group=group,
        nbytes=0,
    )


def gather_object(
    obj: Any,
    output: list[Any] | None = None,
    dst: int = 0,
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Gather a picklable ``obj`` from every rank into ``output`` on ``dst``."""
    _run(
        "gather_object",
        lambda: dist.gather_object(obj, output, dst=dst, group=group),
        group=group,
        nbytes=0,
        detail=f"dst={dst}",
    )


def scatter_object_list(
    output: list[Any],
    inputs: list[Any] | None,
    src: int = 0,
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Scatter picklable ``inputs`` of ``src``; ``output[0]`` receives this rank's one."""
    _run(
        "scatter_object_list",
        lambda: dist.scatter_object_list(output, inputs, src=src, group=group),
        group=group,
        nbytes=0,
        detail=f"src={src}",
    )
