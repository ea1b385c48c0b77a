"""Machinery shared by the Ray and Dask launchers (one worker process per rank).

Both launchers follow the same protocol; only how a worker is started, watched and stopped
differs (:mod:`~torsh_distributed.launch._ray_backend`,
:mod:`~torsh_distributed.launch._dask_backend`).

On the driver (the caller's process):

* :class:`JobSpec` holds the validated arguments of one call;
* :func:`assign_ranks` orders the workers so each node's ranks are contiguous and derives local
  ranks, node ranks and the rendezvous host: ``127.0.0.1`` when every rank is on one node (then
  nothing listens beyond loopback), rank 0's node address otherwise;
* :func:`supervise` waits for every rank's :class:`RankOutcome`, stops waiting as soon as one
  rank failed for a reason of its own (or a short grace after a rank that only saw a peer vanish),
  and raises one error naming the root-cause rank, with its traceback.

On the workers:

* :func:`open_store` (rank 0) binds a socket to port 0 on the rendezvous host and hands it to a
  ``TCPStore``: the kernel picks a free port and nothing can take it between a probe and the bind
  (no fixed ``29500``, no "address already in use");
* :func:`run_rank` sets the torchrun variables, starts the process group with the job's timeout,
  calls the user's function and always tears the group down; it never raises, so what comes back
  to the driver is either an outcome or the news that the process died.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torsh_distributed.launch._teardown import (
    CLEANUP_WAIT_S,
    _await_cleanup,
    _clean_up,
    _destroy_group,
    finish_cleanup,
)
from torsh_distributed.runtime._net import interface_of
from torsh_distributed.runtime.env import environ_set
from torsh_distributed.runtime.errors import (
    DistributedTimeoutError,
    ProcessFailureError,
    TorshDistributedError,
    is_peer_failure,
)

__all__ = [
    "CLEANUP_WAIT_S",
    "DEFAULT_TIMEOUT_S",
    "GRACE_S",
    "JobSpec",
    "Placement",
    "RankOutcome",
    "assign_ranks",
    "close_store",
    "exit_process",
    "failure_error",
    "finish_cleanup",
    "open_store",
    "prepare",
    "run_rank",
    "supervise",
]

DEFAULT_TIMEOUT_S = 300.0
"""Default of ``timeout_s``: start-up, rendezvous and every collective (torch's own default is 30
minutes, the length of the hangs users of other launchers report)."""
GRACE_S = 2.0
"""After a rank failed only because a peer vanished, how long to wait for the peer's own news
(its death is usually noticed a moment later) before stopping the job."""

_BACKENDS = ("auto", "gloo", "nccl", "gloo+shm")
# What torch raises when a collective or the store gives up waiting (with "timed out"/"timeout").
_TORCH_ERRORS = frozenset(
    {"RuntimeError", "DistError", "DistBackendError", "DistStoreError", "DistNetworkError"}
)
# Set by the launcher on every rank; a user's env must not contradict them.
_LAYOUT_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """One launch: what every rank runs and under which limits (validated at construction)."""

    fn: Callable[..., Any]
    """The function every rank calls as ``fn(*args, **kwargs)``; it must pickle (cloudpickle
    sends functions of importable modules by reference, others by value)."""
    num_workers: int
    """Number of ranks, one worker process each."""
    args: tuple[Any, ...] = ()
    """Positional arguments, the same on every rank."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments, the same on every rank."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds allowed for the rendezvous and for each collective."""
    start_timeout_s: float | None = None
    """Seconds allowed to get the workers (placed, started, ``fn``'s imports done);
    ``None``: ``timeout_s`` or :data:`DEFAULT_TIMEOUT_S`, whichever is longer (a short
    ``timeout_s``, set to fail fast on a hung peer, does not shorten the start on a busy host)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables set on every rank for the duration of the call."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (NCCL when every local rank has a GPU, else ``gloo+shm``
    for several ranks of one host or Gloo), ``gloo``, ``nccl`` or ``gloo+shm``."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"fn must be callable, got {type(self.fn).__name__} ({self.fn!r})")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int):
            raise TypeError(f"num_workers must be an int, got {type(self.num_workers).__name__}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not isinstance(self.args, (tuple, list)):
            raise TypeError(f"args must be a tuple or list, got {type(self.args).__name__}")
        object.__setattr__(self, "args", tuple(self.args))
        if not isinstance(self.kwargs, Mapping) or not all(isinstance(k, str) for k in self.kwargs):
            raise TypeError("kwargs must be a mapping with str keys")
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        object.__setattr__(self, "timeout_s", _seconds("timeout_s", self.timeout_s))
        start = (
            max(self.timeout_s, DEFAULT_TIMEOUT_S)
            if self.start_timeout_s is None
            else self.start_timeout_s
        )
        object.__setattr__(self, "start_timeout_s", _seconds("start_timeout_s", start))
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise TypeError("env must be a mapping of str to str")
        clash = sorted(set(self.env) & set(_LAYOUT_VARS))
        if clash:
            raise ValueError(
                f"env must not set {', '.join(clash)}: the launcher sets the job's layout itself"
            )
        object.__setattr__(self, "env", dict(self.env))
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {self.backend!r}")

    @property
    def start_s(self) -> float:
        """``start_timeout_s`` resolved (always a number after construction)."""
        assert self.start_timeout_s is not None
        return self.start_timeout_s


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value}")
    return float(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where one rank sits in the job: what its worker exports in torchrun's variables."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of ranks."""
    local_rank: int
    """Rank among the ranks of its node."""
    local_world_size: int
    """Number of ranks on its node."""
    node_rank: int
    """Index of its node (order of first appearance)."""
    master_addr: str
    """Host of rank 0's rendezvous store."""
    master_port: int = 0
    """Port of the store (0 until rank 0 opened it)."""
    bind_addr: str
    """Address whose interface this rank's Gloo sockets use (loopback on one node)."""


@dataclass(kw_only=True, slots=True)
class RankOutcome:
    """What became of one rank: its return value, or why it failed."""

    rank: int
    """Global rank."""
    ok: bool
    """True when the function returned."""
    value: Any = None
    """The function's return value (``ok`` only)."""
    error: str = ""
    """``Type: message`` of the failure."""
    traceback: str = ""
    """The rank's traceback, when it raised."""
    exception: BaseException | None = None
    """The exception itself, when it could be pickled back (chained as ``__cause__``)."""
    died: bool = False
    """The worker process vanished (killed, crashed, node lost): seen by the launcher."""
    where: str = ""
    """The worker, for messages (``Ray actor ... on 10.0.0.2``, ``Dask worker tcp://...``)."""
    finished_at: float | None = None
    """Wall-clock time (``time.time()`` on the worker) when the function returned or raised."""
    cleanup_s: float | None = None
    """Seconds the worker spent destroying the call's process group before it sent this
    outcome; ``None`` when it did not wait for that (still running, or the worker died)."""

    @property
    def timed_out(self) -> bool:
        """The rank gave up waiting (a collective or the rendezvous hit the timeout)."""
        if isinstance(self.exception, TimeoutError):
            return True
        kind, _, text = self.error.partition(": ")
        text = text.lower()
        return kind in _TORCH_ERRORS and ("timed out" in text or "timeout" in text)

    @property
    def severity(self) -> int:
        """0: died, 1: failed on its own, 2: timed out, 3: only saw a peer vanish."""
        if self.died:
            return 0
        if is_peer_failure(self.error):
            return 3
        return 2 if self.timed_out else 1


# --- the driver --------------------------------------------------------------------------------


def assign_ranks(hosts: Sequence[str]) -> tuple[list[int], list[Placement]]:
    """Order workers by node and describe each rank.

    Args:
        hosts: The node address of each worker, in the order the workers were obtained.

    Returns:
        ``(order, placements)``: rank ``r`` runs on worker ``order[r]`` with ``placements[r]``
        (``master_port`` still 0).
    """
    nodes: dict[str, list[int]] = {}
    for index, host in enumerate(hosts):
        nodes.setdefault(host, []).append(index)
    single_node = len(nodes) == 1
    master = "127.0.0.1" if single_node else hosts[0]
    order: list[int] = []
    placements: list[Placement] = []
    for node_rank, (host, members) in enumerate(nodes.items()):
        for local_rank, index in enumerate(members):
            order.append(index)
            placements.append(
                Placement(
                    rank=len(placements),
                    world_size=len(hosts),
                    local_rank=local_rank,
                    local_world_size=len(members),
                    node_rank=node_rank,
                    master_addr=master,
                    bind_addr="127.0.0.1" if single_node else host,
                )
            )
    return order, placements


def supervise(
    poll: Callable[[float], Iterable[RankOutcome]],
    *,
    world_size: int,
    launcher: str,
    interval_s: float = 0.2,
    grace_s: float = GRACE_S,
) -> list[Any]:
    """Collect every rank's outcome; return the values in rank order or raise.

    Args:
        poll: Waits up to the given seconds and returns the outcomes that arrived (each rank
            once), including ``died`` outcomes for workers the launcher saw vanish.
        world_size: Number of ranks.
        launcher: ``"ray"`` or ``"dask"``, for messages.
        interval_s: Longest single wait; bounds how late a failure is noticed.
        grace_s: After a rank failed only because a peer vanished or timed out, how long to wait
            for the root cause before giving up on the others.

    Raises:
        ProcessFailureError: a rank raised or its worker died (the root cause is named).
        DistributedTimeoutError: the root cause is a rank that gave up waiting for its peers.
    """
    outcomes: dict[int, RankOutcome] = {}
    arrival: dict[int, int] = {}
    first_failure: float | None = None
    while len(outcomes) < world_size:
        if any(not o.ok and o.severity <= 1 for o in outcomes.values()):
            break  # a rank failed on its own: the others can only fail after it
        wait = interval_s
        if first_failure is not None:
            left = grace_s - (time.monotonic() - first_failure)
            if left <= 0:
                break
            wait = min(wait, left)
        for outcome in poll(wait):
            if outcome.rank in outcomes:
                continue
            outcomes[outcome.rank] = outcome
            arrival[outcome.rank] = len(arrival)
            if not outcome.ok and first_failure is None:
                first_failure = time.monotonic()
    if len(outcomes) == world_size and all(o.ok for o in outcomes.values()):
        return [outcomes[rank].value for rank in range(world_size)]
    raise failure_error(outcomes, arrival=arrival, world_size=world_size, launcher=launcher)


def failure_error(
    outcomes: Mapping[int, RankOutcome],
    *,
    arrival: Mapping[int, int],
    world_size: int,
    launcher: str,
) -> TorshDistributedError:
    """One error for a failed job: the root-cause rank with its traceback, the rest briefly."""
    failed = sorted(
        (o for o in outcomes.values() if not o.ok), key=lambda o: (o.severity, arrival[o.rank])
    )
    root = failed[0]
    unfinished = [rank for rank in range(world_size) if rank not in outcomes]
    verb = "died" if root.died else ("timed out" if root.timed_out else "failed")
    lines = [f"rank {root.rank} of {world_size} {verb} ({root.where}): {root.error}"]
    if root.traceback:
        lines.append("  " + root.traceback.rstrip().replace("\n", "\n  "))
    for other in failed[1:]:
        note = " (a consequence of the failure above)" if other.severity == 3 else ""
        lines.append(f"rank {other.rank} ({other.where}): {other.error.splitlines()[0]}{note}")
    if unfinished:
        lines.append(
            f"rank(s) {', '.join(map(str, unfinished))} had not finished and were stopped"
            + (" (a rank that hangs makes its peers time out)" if root.timed_out else "")
        )
    if root.died:
        fix = (
            f"rank {root.rank}'s worker process ended without returning (killed, out of memory, "
            f"crashed, or its node was lost): read that worker's log. With checkpoints "
            "(checkpoint.dir), call again to resume from the newest one."
        )
    elif root.timed_out:
        fix = (
            f"a peer of rank {root.rank} did not arrive within timeout_s: look for a rank that "
            "hangs or is much slower, or raise timeout_s."
        )
    else:
        fix = f"the traceback above is rank {root.rank}'s own error."
    cls = DistributedTimeoutError if root.timed_out and not root.died else ProcessFailureError
    error = cls("\n".join(lines), rank=root.rank, operation=f"launch.{launcher}", fix=fix)
    error.__cause__ = root.exception
    return error


# --- the workers ------------------------------------------------------------------------------


def prepare(spec: JobSpec) -> tuple[str, int]:
    """First call on every worker, under ``start_timeout_s``: return ``(host name, pid)``.

    Receiving ``spec`` imports ``fn``'s module and its arguments' classes, and torch.distributed
    is imported here too, so a fresh worker's slow imports (seconds on a loaded machine) happen
    before the rendezvous, not inside a peer's ``timeout_s``.
    """
    import torch.distributed  # noqa: F401

    assert callable(spec.fn)
    return socket.gethostname(), os.getpid()


_STORES: dict[str, Any] = {}  # job id -> rank 0's TCPStore until its rank picks it up
_STORES_LOCK = threading.Lock()


def open_store(job_id: str, host: str, world_size: int, timeout_s: float) -> int:
    """Start rank 0's rendezvous store on a port the kernel picks; return the port.

    The store is kept in this process under ``job_id`` for :func:`run_rank` of rank 0.
    """
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(max(128, world_size))
        port = int(sock.getsockname()[1])
        store = dist.TCPStore(
            host,
            port,
            world_size,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the listening descriptor now
    with _STORES_LOCK:
        _STORES[job_id] = store
    return port


def close_store(job_id: str) -> bool:
    """Drop a store that :func:`open_store` opened and no rank picked up; True if there was one."""
    with _STORES_LOCK:
        return _STORES.pop(job_id, None) is not None


def _rank_env(placement: Placement, spec: JobSpec) -> dict[str, str]:
    env = {
        "RANK": str(placement.rank),
        "WORLD_SIZE": str(placement.world_size),
        "LOCAL_RANK": str(placement.local_rank),
        "LOCAL_WORLD_SIZE": str(placement.local_world_size),
        "GROUP_RANK": str(placement.node_rank),
        "MASTER_ADDR": placement.master_addr,
        "MASTER_PORT": str(placement.master_port),
    }
    if "GLOO_SOCKET_IFNAME" not in spec.env and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Gloo otherwise picks the interface of the hostname's address, which on one node may be
        # unreachable or missing from /etc/hosts; pin it to the address the store uses.
        name = interface_of(placement.bind_addr)
        if name:
            env["GLOO_SOCKET_IFNAME"] = name
    env.update(spec.env)
    return env


def _portable(exc: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception that cannot travel stays behind
        return None
    return exc


def run_rank(
    job_id: str,
    placement: Placement,
    spec: JobSpec,
    where: str,
    *,
    cleanup_wait_s: float | None = None,
) -> RankOutcome:
    """Run ``spec.fn`` as ``placement.rank`` of the job; never raises.

    The torchrun variables (and ``spec.env``) are set for the call and restored afterwards, since
    a Dask worker process outlives the task. The process group exists when ``spec.fn`` starts
    (``torsh_distributed.init()`` inside it adopts the group) and is destroyed when it returns.

    ``cleanup_wait_s``: after a failure, return the outcome once the group's teardown took this
    long (it goes on in a thread; a later call in the same process waits for it first, and a
    process about to exit calls :func:`finish_cleanup`), so that the driver hears of a failed
    rank at once, not after a clean-up that stopping the job may make moot. For workers that
    the launcher ends after the job (Ray actors, ``horovod.run``'s processes): use
    :data:`CLEANUP_WAIT_S`. ``None`` (the default, for workers that outlive the task, as Dask's):
    always tear down before returning.
    """
    with environ_set(_rank_env(placement, spec)):
        outcome = _call(job_id, placement, spec, where)
    outcome.cleanup_s = _clean_up(None if outcome.ok else cleanup_wait_s)
    return outcome


def _call(job_id: str, placement: Placement, spec: JobSpec, where: str) -> RankOutcome:
    store: Any = None
    try:
        _await_cleanup(spec.start_s)
        _destroy_group()  # a group left over by an earlier task of this process is not ours
        if placement.rank == 0:
            with _STORES_LOCK:
                store = _STORES.pop(job_id)
        else:
            import torch.distributed as dist

            store = dist.TCPStore(
                placement.master_addr,
                placement.master_port,
                placement.world_size,
                False,
                timedelta(seconds=spec.timeout_s),
            )
        from torsh_distributed.runtime import world

        world.init(backend=spec.backend, store=store, timeout=spec.timeout_s)
        value = spec.fn(*spec.args, **spec.kwargs)
        return RankOutcome(
            rank=placement.rank, ok=True, value=value, where=where, finished_at=time.time()
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which raises
        finished = time.time()
        return RankOutcome(
            rank=placement.rank,
            ok=False,
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(),
            exception=_portable(exc),
            where=where,
            finished_at=finished,
        )
    finally:
        store = None  # the outcome's traceback keeps this frame: not rank 0's store with it


async def exit_process() -> None:
    """End this worker process at once (the launcher stops a rank blocked in a collective).

    A coroutine so that Dask runs it on the worker's event loop, not behind the busy task thread.
    """
    os._exit(1)
