"""Start and stop the process group; answer "who am I" questions.

``init()`` is the one entry point: it reads the launcher's environment (torchrun, ``torsh-dist
run``, SLURM, Open MPI) or explicit arguments, validates them *before* touching torch.distributed,
picks the backend (NCCL when every local rank has a CUDA device, else ``gloo+shm`` for several
ranks of one host or Gloo), selects this rank's
device, and returns a :class:`Runtime` that is also a context manager::

    import torsh_distributed as tdist

    with tdist.init() as rt:
        print(rt.rank, rt.world_size, rt.device)
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.runtime.env import DEFAULT_MASTER_PORT, WorldInfo, detect_environment
from torsh_distributed.runtime.errors import (
    ConfigurationError,
    DistributedTimeoutError,
    RankOutOfRangeError,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "Runtime",
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "world_size",
    "local_rank",
    "local_world_size",
    "node_rank",
    "barrier",
    "current",
    "resolve_backend",
]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl", "gloo+shm")
DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True, kw_only=True, slots=True)
class Runtime:
    """A started job, as seen from this process. Returned by :func:`init`."""

    info: WorldInfo
    """Layout of the job."""
    backend: str
    """The resolved backend, ``"gloo"``, ``"nccl"`` or ``"gloo+shm"``."""
    device: torch.device
    """This rank's device (``cuda:<local_rank>`` under NCCL, else ``cpu``)."""
    timeout: timedelta
    """Default timeout of collectives and store operations."""
    owns_group: bool
    """Whether :func:`init` created the process group (and :func:`shutdown` should destroy it)."""

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that prints, logs and writes summaries)."""
        return self.info.rank == 0

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        shutdown()


_current: Runtime | None = None


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    return value


def resolve_backend(backend: str, *, local_world_size: int = 1) -> str:
    """Turn ``"auto"`` into ``"nccl"``, ``"gloo+shm"`` or ``"gloo"``; reject impossible choices.

    ``auto``: NCCL when CUDA has a device for each local rank; else ``gloo+shm`` when there are
    several local ranks and the shared-memory backend can run here (Linux, a writable
    ``/dev/shm``, its C helper built); else Gloo.

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: unknown backend, or NCCL without enough CUDA devices.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    name = backend.lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        if cuda_devices >= local_world_size and cuda_devices > 0:
            return "nccl"
        return _auto_cpu_backend(local_world_size)
    if name == "nccl":
        if cuda_devices == 0:
            raise ValueError(
                "backend 'nccl' needs CUDA but no CUDA device is available; "
                "use backend='gloo' (or 'auto') on CPU"
            )
        if not dist.is_nccl_available():
            raise ValueError("backend 'nccl' is not built into this torch; use 'gloo'")
    if name == "gloo+shm":
        from torsh_distributed.runtime.shm import register

        register()
    return name


def _auto_cpu_backend(local_world_size: int) -> str:
    """``gloo+shm`` when several ranks share this host and its shared memory works, else Gloo.

    The shared-memory collectives beat Gloo's loopback TCP at every size measured (1 KB to
    256 MB, docs/benchmarks.md), so there is no size threshold. Chosen this way, a group whose
    segment cannot be made (a small ``/dev/shm``) warns and runs on Gloo instead of failing.
    """
    if local_world_size < 2:
        return "gloo"
    from torsh_distributed.runtime import shm

    why_not = shm.unavailable_reason()
    if why_not is not None:
        log.info("backend 'auto' -> gloo (gloo+shm unavailable: %s)", why_not)
        return "gloo"
    shm.register()
    shm.set_lenient(True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    log.info(
        "backend 'auto' -> gloo+shm: %d ranks share this host (%s usable cores); collectives "
        "inside it go through shared memory in few large phases (measured ahead of Gloo beside "
        "CPU-heavy neighbours up to 2 ranks per core: docs/benchmarks.md), between hosts through "
        "Gloo (backend='gloo' to opt out)",
        local_world_size,
        cores,
    )
    return "gloo+shm"


def _explicit_info(
    rank: int | None, world_size: int | None, env: Mapping[str, str]
) -> WorldInfo | None:
    if rank is None and world_size is None:
        return None
    if rank is None or world_size is None:
        raise ValueError("pass both rank and world_size, or neither (to read them from the environment)")
    _check_int("rank", rank)
    _check_int("world_size", world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise RankOutOfRangeError(
            f"rank {rank} is out of range for world_size {world_size}",
            rank=rank,
            operation="init",
            fix="ranks run from 0 to world_size - 1.",
        )
    local_world = int(env.get("LOCAL_WORLD_SIZE", world_size))
    local_rank = int(env.get("LOCAL_RANK", rank % local_world))
    return WorldInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=rank // local_world,
        master_addr=env.get("MASTER_ADDR"),
        master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
        source="explicit",
    )


def init(
    *,
    backend: str = "auto",
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    store: dist.Store | None = None,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
) -> Runtime:
    """Start (or join) the default process group and return this process's :class:`Runtime`.

    Args:
        backend: ``"auto"`` (NCCL when CUDA has a device for each local rank; else ``gloo+shm``
            when several ranks share this host and shared memory works here; else Gloo),
            ``"gloo"``, ``"nccl"`` or ``"gloo+shm"`` (shared-memory collectives inside a node,
            Gloo between nodes and for everything else; see docs/shm.md).
        rank: This process's global rank. Give it with ``world_size`` to ignore the
            environment; leave both ``None`` to read torchrun / SLURM / Open MPI variables.
        world_size: Number of processes. A world of one needs no rendezvous at all.
        init_method: A torch init URL (``"tcp://host:port"``, ``"file:///path"``, ``"env://"``).
            Default: ``env://`` (``MASTER_ADDR``/``MASTER_PORT``), or the launcher's master.
        store: A ready :class:`torch.distributed.Store` (for example our ``RedisStore``) to
            rendezvous through; exclusive with ``init_method``.
        timeout: Default timeout for collectives; a peer that never arrives raises after it.
        env: Environment to read instead of ``os.environ`` (for tests).

    Returns:
        The :class:`Runtime`; ``with init() as rt:`` shuts down on exit.

    Raises:
        TypeError / ValueError: bad arguments, raised before any process group is touched.
        ConfigurationError: the environment cannot describe a job (e.g. no master address).
        DistributedTimeoutError: peers did not join within ``timeout``.
    """
    global _current
    env = os.environ if env is None else env
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=float(timeout))
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a timedelta or seconds, got {type(timeout).__name__}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if init_method is not None and store is not None:
        raise ValueError("pass init_method or store, not both")
    if store is not None and not isinstance(store, dist.Store):
        raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")

    info = _explicit_info(rank, world_size, env) or detect_environment(env)
    if info is None:  # plain `python script.py`: a world of one
        info = WorldInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0)
    resolved = resolve_backend(backend, local_world_size=info.local_world_size)

    if dist.is_initialized():
        if _current is not None:
            return _current
        # Someone else (e.g. a user's own code) started the group: adopt it, do not own it.
        adopted = _device_for(resolved, info)
        _current = Runtime(
            info=info, backend=dist.get_backend(), device=adopted, timeout=timeout, owns_group=False
        )
        return _current

    kwargs: dict[str, Any] = {
        "backend": resolved,
        "rank": info.rank,
        "world_size": info.world_size,
        "timeout": timeout,
    }
    if store is not None:
        kwargs["store"] = store
    elif init_method is not None:
        kwargs["init_method"] = init_method
    elif info.world_size == 1 and info.master_addr is None:
        kwargs["store"] = dist.HashStore()
    elif info.master_addr is None and info.source == "mpi":  # mpirun names no master: derive one
        from torsh_distributed.runtime._mpi import rendezvous

        rdzv = rendezvous(info, env, timeout=timeout)
        info = replace(info, master_addr=rdzv.master_addr, master_port=rdzv.master_port)
        kwargs["store"] = rdzv.store
        gloo = resolved in ("gloo", "gloo+shm")
        if gloo and rdzv.gloo_ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = rdzv.gloo_ifname
    else:
        if info.master_addr is None:
            raise ConfigurationError(
                f"no rendezvous address for a world of {info.world_size} ({info.source} layout)",
                rank=info.rank,
                operation="init",
                fix="export MASTER_ADDR (and MASTER_PORT), pass init_method='tcp://host:port', "
                "or launch with `torsh-dist run`.",
            )
        port = info.master_port or DEFAULT_MASTER_PORT
        kwargs["init_method"] = f"tcp://{info.master_addr}:{port}"

    device = _device_for(resolved, info)
    try:
        dist.init_process_group(**kwargs)
    except (RuntimeError, dist.DistStoreError) as exc:  # DistStoreError covers timeouts
        text = str(exc)
        if "timeout" in text.lower() or "timed out" in text.lower():
            raise DistributedTimeoutError(
                f"peers did not join within {timeout}: {text.splitlines()[0]}",
                rank=info.rank,
                operation="init_process_group",
                fix="check that all ranks started and reach the same master address/port.",
            ) from exc
        raise
    _current = Runtime(info=info, backend=resolved, device=device, timeout=timeout, owns_group=True)
    log.debug("initialised %s", _current)
    return _current


def _device_for(backend: str, info: WorldInfo) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def shutdown() -> None:
    """Destroy the process group that :func:`init` created. Safe to call twice or without init."""
    global _current
    runtime, _current = _current, None
    if runtime is None or not runtime.owns_group or not dist.is_initialized():
        return
    # Free unreachable objects that still hold process groups (a DDP wrapper in a reference
    # cycle, a mesh) now, while the interpreter is whole: left to the final collection at exit,
    # destroying Gloo's state there can abort the process (torch issue #190489's symptom).
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.destroy_process_group()


atexit.register(shutdown)


def current() -> Runtime | None:
    """The :class:`Runtime` returned by the last :func:`init`, or ``None``."""
    return _current


def is_initialized() -> bool:
    """True while a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank of this process (0 when not distributed)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    return dist.get_world_size() if is_initialized() else 1


def _info() -> WorldInfo | None:
    if _current is not None:
        return _current.info
    return detect_environment(os.environ)


def local_rank() -> int:
    """Rank among this node's processes (0 when not distributed)."""
    info = _info()
    return info.local_rank if info else 0


def local_world_size() -> int:
    """Number of processes on this node (1 when not distributed)."""
    info = _info()
    return info.local_world_size if info else 1


def node_rank() -> int:
    """Index of this node (0 when not distributed)."""
    info = _info()
    return info.node_rank if info else 0


def barrier(*, timeout: timedelta | float | None = None) -> None:
    """Block until every rank arrives; raise :class:`DistributedTimeoutError` after ``timeout``.

    Implemented with ``monitored_barrier`` on Gloo so a timeout names the ranks that never came.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=float(timeout))
    if timeout is None and _current is not None:
        timeout = _current.timeout
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as exc:
        raise DistributedTimeoutError(
            str(exc).splitlines()[0],
            rank=dist.get_rank(),
            operation="barrier",
            fix="the ranks named above never reached the barrier: look at their logs or stacks.",
        ) from exc
