"""Horovod's basics on our runtime: ``init``/``shutdown``, who-am-I, reduce ops, process sets,
build flags and the two exceptions of Horovod's elastic mode.

``init()`` starts the default process group through :func:`torsh_distributed.runtime.init`, which
reads the torchrun variables that ``torsh-dist run`` / ``torsh-dist horovodrun`` set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ...), as
well as SLURM's and Open MPI's; a plain ``python script.py`` is a world of one, as under Horovod.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import enum
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.comm import collectives as C
from torsh_distributed.runtime import world as _world
from torsh_distributed.runtime.errors import CommunicationError

__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "Op",
    "ProcessSet",
    "Product",
    "Sum",
    "ccl_built",
    "check_process_set",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "resolve_op",
    "rocm_built",
    "shutdown",
    "size",
]


class Op(enum.IntEnum):
    """Horovod's reduction operators (the integer values are Horovod's)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = Op.AVERAGE
Sum = Op.SUM
Adasum = Op.ADASUM
Min = Op.MIN
Max = Op.MAX
Product = Op.PRODUCT


class HorovodInternalError(CommunicationError, RuntimeError):
    """A collective failed (usually because a peer died).

    Raised by :func:`synchronize` and the blocking collectives in place of the backend's
    ``RuntimeError``. Under :func:`torsh_distributed.compat.horovod.torch.elastic.run` it ends the
    worker after rolling the state back; the launcher (``--max-restarts`` / ``--reset-limit``)
    then restarts every worker, and they resume from the last durable commit.
    """

    def __init__(
        self,
        message: object = "",
        *,
        rank: int | None = None,
        operation: str | None = None,
        fix: str | None = None,
    ) -> None:
        super().__init__(str(message), rank=rank, operation=operation, fix=fix)


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Horovod's signal that hosts were added or removed.

    Nothing here raises it (a membership change reaches the workers as a restart by torch's
    elastic agent), but code may raise it itself: ``elastic.run`` then runs the reset callbacks
    and calls the function again, syncing first unless ``skip_sync``.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(f"hosts updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


@dataclass(frozen=True, slots=True)
class _Layout:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool


_layout: _Layout | None = None


class ProcessSet:
    """Horovod's process set; only the global one exists here.

    ``add_process_set`` (sub-groups of ranks) is not supported: every operation runs on the
    whole job, and passing any other process set raises ``NotImplementedError``.
    """

    process_set_id = 0

    def __init__(self, ranks: list[int] | None = None) -> None:
        if ranks is not None:
            raise NotImplementedError(
                "ProcessSet(ranks) is not supported by torsh_distributed's Horovod API: "
                "operations always run on the global process set"
            )
        self.ranks = None

    def size(self) -> int:
        """Number of ranks in the set (the world)."""
        return size()

    def rank(self) -> int:
        """This process's rank in the set (its global rank)."""
        return rank()

    def included(self) -> bool:
        """Whether this process belongs to the set (always, for the global set)."""
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def check_process_set(process_set: Any) -> None:
    """Accept ``None`` or the global process set; refuse any other set clearly."""
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(
            f"process_set={process_set!r}: only hvd.global_process_set is supported "
            "(process sets / add_process_set are not implemented)"
        )


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start the job (``hvd.init()``): join the default process group and learn the layout.

    Collective on every rank. A second call does nothing while the job is running.

    Args:
        comm: Horovod's MPI communicator (or list of ranks); not supported, must be ``None``.
        process_sets: Horovod's process sets; not supported, must be ``None``.

    Raises:
        NotImplementedError: ``comm`` or ``process_sets`` was given.
        ConfigurationError / DistributedTimeoutError: from :func:`torsh_distributed.init`.
    """
    global _layout
    if comm is not None:
        raise NotImplementedError(
            "hvd.init(comm=...) is not supported: there is no MPI here; launch with "
            "`torsh-dist horovodrun -np N` (or `torsh-dist run`) and call hvd.init()"
        )
    if process_sets is not None:
        raise NotImplementedError("hvd.init(process_sets=...) is not supported (no process sets)")
    if _layout is not None and dist.is_initialized():
        return
    rt = _world.init()
    atexit.unregister(_leave_together)
    atexit.register(_leave_together)  # runs before the runtime's own exit hook
    info = rt.info
    me = (info.rank, info.node_rank, info.local_rank, info.local_world_size)
    everyone: list[Any] = [None] * info.world_size
    if info.world_size > 1:
        C.all_gather_object(everyone, me)
    else:
        everyone = [me]
    same_local = [r for r, _, lr, _ in everyone if lr == info.local_rank]
    _layout = _Layout(
        rank=info.rank,
        size=info.world_size,
        local_rank=info.local_rank,
        local_size=info.local_world_size,
        cross_rank=sorted(same_local).index(info.rank),
        cross_size=len(same_local),
        homogeneous=len({ls for *_, ls in everyone}) == 1,
    )


def _leave_together() -> None:
    """At exit (Horovod scripts rarely call ``hvd.shutdown()``): wait, at most 10 s, until every
    rank is leaving, then destroy the group. Measured under load: a rank that tears its Gloo
    group down while a peer still holds its connections can abort the peer at exit
    ("terminate called without an active exception")."""
    if _layout is None or not dist.is_initialized():
        return
    if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):  # a dead peer: leave anyway, bounded
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
    shutdown()


def shutdown() -> None:
    """Leave the job (``hvd.shutdown()``): destroy the process group ``init`` created."""
    global _layout
    _layout = None
    _world.shutdown()


def is_initialized() -> bool:
    """Whether :func:`init` ran and the job is up."""
    return _layout is not None and dist.is_initialized()


def _require() -> _Layout:
    if _layout is None or not dist.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _layout


def rank() -> int:
    """Global rank of this process."""
    return _require().rank


def size() -> int:
    """Number of processes in the job."""
    return _require().size


def local_rank() -> int:
    """Rank among the processes of this host (selects the GPU)."""
    return _require().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return _require().local_size


def cross_rank() -> int:
    """Index of this host among the hosts that run a process with this local rank."""
    return _require().cross_rank


def cross_size() -> int:
    """Number of hosts that run a process with this local rank (the node count when every host
    runs the same number of processes)."""
    return _require().cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return _require().homogeneous


# -- build flags: what this implementation can use, not what some Horovod build had ------------
def mpi_built() -> bool:
    """False: this implementation has no MPI transport (Gloo or NCCL through torch)."""
    return False


def mpi_enabled() -> bool:
    """False: MPI is never used."""
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI."""
    return False


def gloo_built() -> bool:
    """Whether torch.distributed has the Gloo backend."""
    return bool(dist.is_available() and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether the running job uses Gloo (before ``init``: whether it would be available)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_backend() in ("gloo", "gloo+shm")
    return gloo_built()


def nccl_built() -> bool:
    """Whether torch.distributed has the NCCL backend (a CUDA build of torch)."""
    return bool(dist.is_available() and dist.is_nccl_available())


def cuda_built() -> bool:
    """Whether torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False


def resolve_op(op: Any, average: bool | None = None) -> Op:
    """Horovod's op argument with the deprecated ``average=`` flag; ``None`` means Average."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn(
            "average= is deprecated in Horovod; use op=hvd.Average or op=hvd.Sum",
            DeprecationWarning,
            stacklevel=3,
        )
        return Op.AVERAGE if average else Op.SUM
    if op is None:
        return Op.AVERAGE
    try:
        return Op(int(op))
    except (TypeError, ValueError):
        names = ", ".join(f"hvd.{o.name.title()}" for o in Op)
        raise ValueError(f"unknown reduction op {op!r}; use one of {names}") from None
