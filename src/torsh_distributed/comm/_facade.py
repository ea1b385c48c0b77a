"""Machinery of the collectives facade: the ``Work`` handle, algorithm resolution and ``_run``
(debug fingerprint, profiler record, timeout translation) shared by every public function."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from torsh_distributed.comm import debug as _debug
from torsh_distributed.comm import profiler as _profiler
from torsh_distributed.comm._hot import HOT as _HOT
from torsh_distributed.comm.algorithms import ALGORITHMS
from torsh_distributed.comm.algorithms._p2p import members
from torsh_distributed.comm.cost_model import CostModel
from torsh_distributed.comm.dims import current_dims, group_name
from torsh_distributed.comm.reduce_op import ReduceOp, finish_mean_
from torsh_distributed.runtime.errors import DistributedTimeoutError

_FALLBACK_MODEL = CostModel()


class Work:
    """Handle of an asynchronous collective: ``wait()`` blocks, then runs the finishing step."""

    def __init__(self, work: Any | None, finish: Callable[[], None] | None = None) -> None:
        self._work = work
        self._finish = finish
        self._done = work is None

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done:
            if timeout is None:
                self._work.wait()
            else:
                from datetime import timedelta

                self._work.wait(timedelta(seconds=timeout))
            self._done = True
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())


def default_cost_model() -> CostModel:
    """The cost model of the current ParallelDims, or a default one."""
    dims = current_dims()
    return dims.cost_model if dims is not None else _FALLBACK_MODEL


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


_NATIVE_AVG: dict[int, bool] = {}


def _native_avg(group: dist.ProcessGroup | None) -> bool:
    """Whether the group's backend has AVG (NCCL); cached: the facade's hot path stays short."""
    key = id(group)
    found = _NATIVE_AVG.get(key)
    if found is None:
        found = _NATIVE_AVG[key] = dist.get_backend(group) == "nccl"
    return found


def _hier_groups(group: dist.ProcessGroup | None) -> tuple[Any, Any] | None:
    dims = current_dims()
    if dims is None or not dims.hierarchical:
        return None
    if group is not None and group != dist.group.WORLD and _size(group) != dist.get_world_size():
        return None
    return dims.intra_group, dims.inter_group


def resolve_algorithm(
    algorithm: str, op_name: str, nbytes: int, group: dist.ProcessGroup | None
) -> str:
    """The concrete algorithm for ``algorithm`` (``"auto"`` asks the cost model)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if algorithm == "hierarchical" and op_name == "all_reduce" and _hier_groups(group) is None:
        raise ValueError(
            "algorithm='hierarchical' needs ParallelDims(...).build() with several nodes holding "
            "the same number of ranks, on the world group; see docs/communication.md"
        )
    if algorithm != "auto":
        return algorithm
    dims = current_dims()
    nodes = dims.num_nodes if dims is not None and _hier_groups(group) is not None else 1
    candidates = (
        ("torch", "ring", "tree", "hierarchical") if op_name == "all_reduce" else ("torch", "tree")
    )
    return default_cost_model().choose(
        op_name, nbytes, ranks=_size(group), nodes=nodes, candidates=candidates
    )


_ENV_DEBUG = [True]  # check TORSH_COMM_DEBUG once, at the first facade collective


def _env_debug() -> None:
    """``TORSH_COMM_DEBUG=1`` (timeout ``TORSH_COMM_DEBUG_TIMEOUT`` s, default 60) turns debug mode on."""
    _ENV_DEBUG[0] = False
    if os.environ.get("TORSH_COMM_DEBUG", "") in ("1", "true", "yes") and not _debug.enabled():
        _debug.enable(
            timeout=float(os.environ.get("TORSH_COMM_DEBUG_TIMEOUT", "60")),
            dump_dir=os.environ.get("TORSH_COMM_DEBUG_DIR") or None,
        )


def plain() -> bool:
    """Neither debug mode nor the profiler is on: a call may go straight to torch."""
    if _ENV_DEBUG[0]:
        _env_debug()
    hot = _HOT[0] = not _debug.enabled() and _profiler.active() is None
    return hot


def _timeout_error(exc: RuntimeError, op_name: str, group: dist.ProcessGroup | None) -> Exception:
    """``DistributedTimeoutError`` for a torch timeout, else ``exc`` itself."""
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return DistributedTimeoutError(
            f"{op_name} on {group_name(group)} timed out: {text.splitlines()[0]}",
            rank=dist.get_rank(),
            operation=op_name,
            fix="a peer never arrived; rerun with TORSH_COMM_DEBUG=1 for a who-is-missing report.",
        )
    return exc


def reraise(exc: RuntimeError, op_name: str, group: Any = None) -> NoReturn:
    """Raise, from inside the ``except`` of a facade op's hot path, either the
    ``DistributedTimeoutError`` that ``exc`` stands for or ``exc`` itself.

    The hot path (taken when :func:`plain`) calls torch inline, with no helper call on the way:
    straight after a barrier every Python frame costs about a microsecond (cold caches), which
    was 1-3 % of a 1 MB collective."""
    error = _timeout_error(exc, op_name, group)
    if error is exc:
        raise exc
    raise error from exc


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def _run(
    op_name: str,
    body: Callable[[], Any],
    *,
    group: dist.ProcessGroup | None,
    nbytes: int,
    algorithm: str = "torch",
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    detail: str = "",
    finish: Callable[[], None] | None = None,
    async_op: bool = False,
) -> Work | None:
    """Debug check, profile, run ``body`` (returns a torch Work when async) and finish."""
    if _ENV_DEBUG[0]:
        _env_debug()
    debugging, prof = _debug.enabled(), _profiler.active()
    label = group_name(group) if debugging or prof is not None else ""
    if debugging:
        _debug.check(
            op_name,
            group=group,
            group_label=label,
            ranks=members(group),
            shape=shape,
            dtype=str(dtype).removeprefix("torch.") if dtype is not None else "-",
            detail=detail,
        )
    start = prof.now_us() if prof is not None else 0.0
    try:
        handle = body()
    except RuntimeError as exc:
        error = _timeout_error(exc, op_name, group)
        if error is exc:
            raise
        raise error from exc

    if finish is None and prof is None:
        if async_op:
            return (
                handle
                if isinstance(handle, Work)
                else Work(handle if hasattr(handle, "wait") else None)
            )
        return None

    def done() -> None:
        if finish is not None:
            finish()
        if prof is not None:
            prof.record(op_name, nbytes, label, _size(group), algorithm, start)

    if async_op and hasattr(handle, "wait") and not isinstance(handle, Work):
        return Work(handle, done)
    done()
    return Work(None) if async_op else None


def _mean_finisher(
    tensor: torch.Tensor, op: ReduceOp, group: dist.ProcessGroup | None, native: bool
) -> Callable[[], None] | None:
    """The division that completes an emulated MEAN (``None`` when not needed)."""
    if op is not ReduceOp.MEAN or native:
        return None
    count = _size(group)

    def finish() -> None:
        finish_mean_(tensor, op, count)

    return finish


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
