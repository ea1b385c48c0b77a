"""What :func:`torsh_distributed.elastic.launch.launch` is told: :class:`LaunchOptions`, validated.

Its own module so that the launcher and the rendezvous planning (``_rendezvous``) both import it
and neither imports the other.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torsh_distributed.elastic._warm import check_start_method

__all__ = [
    "LaunchOptions", "parse_nnodes", "RDZV_BACKENDS", "RDZV_CONF_KEYS", "DEFAULT_C10D_PORT",
    "UNREACHABLE_AFTER_S", "launch_target",
]

RDZV_BACKENDS = ("c10d", "static")
RDZV_CONF_KEYS = (
    "last_call_timeout",
    "join_timeout",
    "close_timeout",
    "read_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)
DEFAULT_C10D_PORT = 29400
UNREACHABLE_AFTER_S = 10.0
"""Default of :attr:`LaunchOptions.master_timeout`."""


def launch_target(script: str | None, module: str | None, args: Sequence[str]) -> list[str]:
    """The interpreter arguments that start ``script`` or ``module`` (``["--", script]`` or
    ``["-m", module]``), checked without importing torch: the CLI refuses a missing script before
    its launch imports anything.

    Raises:
        TypeError / ValueError: both or neither of ``script`` and ``module``, ``args`` not strings,
            a script that is not a file, a module name that is not one.
    """
    if (script is None) == (module is None):
        raise ValueError("pass exactly one of script= (a .py file) and module= (like python -m)")
    if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be a sequence of str, got {args!r}")
    if script is not None:
        if not os.path.isfile(script):
            raise ValueError(f"script {script!r} is not a file (working directory {os.getcwd()})")
        return ["--", script]
    assert module is not None
    if not module or module.startswith("-"):
        raise ValueError(f"module must be a module name like 'pkg.train', got {module!r}")
    return ["-m", module]


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """``"N"`` -> ``(N, N)``; ``"MIN:MAX"`` -> ``(MIN, MAX)``; ValueError naming ``nnodes``."""
    parts = str(nnodes).split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"nnodes must be 'N' or 'MIN:MAX' (integers), got {nnodes!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"nnodes must satisfy 1 <= MIN <= MAX, got {nnodes!r}")
    return low, high


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


@dataclass(kw_only=True, slots=True)
class LaunchOptions:
    """How to start a job: processes per node, nodes, rendezvous, restarts and logs.

    The fields mirror ``torchrun``'s flags (``--nproc-per-node`` is ``nproc_per_node``, ...).
    """

    nproc_per_node: int = 1
    """Worker processes on this node (usually one per GPU). With more than one and
    ``OMP_NUM_THREADS`` unset, workers get ``OMP_NUM_THREADS=1`` as under torchrun, so N ranks do
    not each start a thread per core."""
    nnodes: str = "1"
    """Number of nodes: ``"N"``, or ``"MIN:MAX"`` for an elastic job (needs ``rdzv_endpoint``),
    which starts once MIN nodes have joined (after torch's 30 s last call for more) and admits up
    to MAX."""
    node_rank: int = 0
    """This node's index in ``[0, N)`` for a static rendezvous. The c10d rendezvous numbers the
    nodes itself and ignores it (with a warning)."""
    master_addr: str = "127.0.0.1"
    """Static rendezvous: address of node 0, where the store runs; every node passes the same one.
    On one node it is also the only address the store listens on: loopback keeps the job private."""
    master_port: int | None = None
    """Static rendezvous port. ``None``: a port the OS picks on one node; 29500 (torch's default)
    on several nodes, which must agree on it without talking first."""
    rdzv_endpoint: str | None = None
    """``host[:port]`` of the rendezvous for ``rdzv_backend`` (c10d's default port is 29400; the
    node whose host name matches runs the store). Needed for elastic jobs; overrides
    ``master_addr``/``master_port``."""
    rdzv_backend: str = "c10d"
    """Rendezvous used with ``rdzv_endpoint``: ``"c10d"`` (elastic, torch's recommendation) or
    ``"static"`` (fixed node count, ranked by ``node_rank``). Without an endpoint the launcher uses
    a static rendezvous on ``master_addr``."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Settings of the c10d rendezvous (torchrun's ``--rdzv-conf``), seconds as strings:
    ``last_call_timeout`` (default 30: after MIN nodes joined, how long to wait for more before
    starting; also each time an elastic job re-forms), ``join_timeout`` (600), ``close_timeout``
    (30), ``read_timeout`` (60), ``keep_alive_interval`` (5) and ``keep_alive_max_attempt`` (3):
    a node whose agent stops answering for interval x attempts is dropped at the next round."""
    rdzv_id: str = "torsh"
    """Job id shared by all nodes of a job; jobs sharing one rendezvous endpoint need distinct ids."""
    max_restarts: int = 0
    """How often the whole worker group is restarted after a failure before the job fails.
    Workers read ``TORCHELASTIC_RESTART_COUNT`` to resume, e.g. from a checkpoint."""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks of its workers: lower notices a failure sooner, higher
    costs less CPU."""
    master_timeout: float = UNREACHABLE_AFTER_S
    """Several nodes: seconds of silence from the master's address (no answer at all: a wrong
    address or a firewall that drops the traffic) after which a node gives up, naming the address
    and its interface. Lower fails sooner; too low gives up on a slow or congested network.
    "Connection refused" (node 0 not started yet) is not silence: it is waited for up to the
    rendezvous timeout."""
    log_dir: str | None = None
    """Keep each worker's ``stdout.log``, ``stderr.log`` and ``error.json`` (a failed worker's
    traceback) under ``<log_dir>/<rdzv_id>_*/attempt_<n>/<local_rank>/``. ``None``: a temporary
    directory removed when the job ends. The console shows the same output either way."""
    local_ranks_filter: frozenset[int] | None = None
    """Local ranks whose output reaches the console (``None``: all); the others still write to
    ``log_dir``. Useful when many ranks print the same lines."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the workers, on top of this process's environment."""
    verbose: bool = False
    """Show torch's elastic agent logs (rendezvous, restarts, closing signals) at INFO level."""
    start_method: str = "forkserver"
    """How workers start (torchrun's ``--start-method``). ``"forkserver"``: forked from one
    process that imported torch once, started early so the imports overlap the launcher's own
    work; saves each worker (and each elastic restart) the ~3.5 CPU s of importing torch and
    ``torch._dynamo``. A worker still sees the launcher's environment, working directory and
    ``sys.argv`` as a fresh one would, but its command line in ``ps`` is the forkserver's.
    ``"spawn"``: one fresh ``python -u -m ...`` per worker. ``PYTHON_EXEC`` (another
    interpreter) implies ``"spawn"``."""

    def __post_init__(self) -> None:
        _check_int("nproc_per_node", self.nproc_per_node, low=1)
        check_start_method(self.start_method)
        if not isinstance(self.nnodes, str):
            raise TypeError(
                f"nnodes must be a str ('N' or 'MIN:MAX'), got {type(self.nnodes).__name__}"
            )
        min_nodes, max_nodes = parse_nnodes(self.nnodes)
        _check_int("node_rank", self.node_rank, low=0)
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(
                f"master_addr must be a host name or IP address, got {self.master_addr!r}"
            )
        if self.master_port is not None:
            _check_int("master_port", self.master_port, low=1, high=65535)
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(
                f"rdzv_backend must be one of {', '.join(RDZV_BACKENDS)}, got {self.rdzv_backend!r}"
            )
        if self.rdzv_endpoint is not None:
            # torch's own parser (what the agent will use), imported only for an endpoint: the
            # other checks run in `torsh-dist` before torch is loaded.
            from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

            try:
                parse_rendezvous_endpoint(self.rdzv_endpoint, default_port=DEFAULT_C10D_PORT)
            except ValueError as exc:
                raise ValueError(f"rdzv_endpoint must be 'host[:port]': {exc}") from None
            if not self.rdzv_endpoint.strip():
                raise ValueError("rdzv_endpoint must be 'host[:port]', got an empty string")
        if not isinstance(self.rdzv_conf, Mapping):
            raise TypeError(f"rdzv_conf must be a mapping, got {type(self.rdzv_conf).__name__}")
        for key, value in self.rdzv_conf.items():
            if key not in RDZV_CONF_KEYS:
                raise ValueError(
                    f"rdzv_conf: unknown key {key!r}; known: {', '.join(RDZV_CONF_KEYS)}"
                )
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"rdzv_conf: {key} must be a number, got {value!r}") from None
            if not number > 0:
                raise ValueError(f"rdzv_conf: {key} must be > 0, got {value!r}")
        self.rdzv_conf = {k: str(v) for k, v in self.rdzv_conf.items()}
        if self.rdzv_conf and (self.rdzv_endpoint is None or self.rdzv_backend != "c10d"):
            raise ValueError("rdzv_conf applies to the c10d rendezvous (rdzv_endpoint set)")
        if not isinstance(self.rdzv_id, str) or not self.rdzv_id:
            raise ValueError(f"rdzv_id must be a non-empty string, got {self.rdzv_id!r}")
        _check_int("max_restarts", self.max_restarts, low=0)
        if isinstance(self.monitor_interval, bool) or not isinstance(
            self.monitor_interval, (int, float)
        ):
            raise TypeError(f"monitor_interval must be a number, got {self.monitor_interval!r}")
        if not self.monitor_interval > 0:
            raise ValueError(f"monitor_interval must be > 0 seconds, got {self.monitor_interval}")
        if isinstance(self.master_timeout, bool) or not isinstance(
            self.master_timeout, (int, float)
        ):
            raise TypeError(f"master_timeout must be a number, got {self.master_timeout!r}")
        if not self.master_timeout > 0:
            raise ValueError(f"master_timeout must be > 0 seconds, got {self.master_timeout}")
        if self.log_dir is not None and not str(self.log_dir):
            raise ValueError("log_dir must be a directory path or None, got an empty string")
        if self.local_ranks_filter is not None:
            ranks = frozenset(self.local_ranks_filter)
            bad = sorted(
                r for r in ranks if not isinstance(r, int) or not 0 <= r < self.nproc_per_node
            )
            if not ranks or bad:
                raise ValueError(
                    f"local_ranks_filter must hold local ranks in [0, {self.nproc_per_node}), "
                    f"got {sorted(ranks)}"
                )
            self.local_ranks_filter = ranks
        if not isinstance(self.env, Mapping):
            raise TypeError(f"env must be a mapping of str to str, got {type(self.env).__name__}")
        for key, value in self.env.items():
            if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
                raise ValueError(f"env must map variable names to strings, got {key!r}: {value!r}")
        self.env = dict(self.env)

        static = self.rdzv_endpoint is None or self.rdzv_backend == "static"
        if static and min_nodes != max_nodes:
            raise ValueError(
                f"nnodes={self.nnodes!r} is elastic (MIN:MAX) and needs rdzv_endpoint with "
                "rdzv_backend='c10d'; a static rendezvous needs a fixed node count"
            )
        if static and self.node_rank >= max_nodes:
            raise ValueError(f"node_rank must be < nnodes ({max_nodes}), got {self.node_rank}")
        if self.rdzv_endpoint is not None:
            if self.rdzv_backend == "c10d" and self.node_rank != 0:
                warnings.warn(
                    f"node_rank={self.node_rank} is ignored: the c10d rendezvous numbers nodes itself",
                    stacklevel=3,
                )
            if self.master_addr != "127.0.0.1" or self.master_port is not None:
                warnings.warn(
                    "master_addr/master_port are ignored when rdzv_endpoint is set",
                    stacklevel=3,
                )

    @property
    def min_nodes(self) -> int:
        """Nodes that must join before the job starts."""
        return parse_nnodes(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        """Most nodes the job admits."""
        return parse_nnodes(self.nnodes)[1]
