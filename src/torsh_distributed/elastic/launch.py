"""Launch a script or module on N processes per node, through torch's elastic agent.

:func:`launch` is ``torchrun`` behind a smaller, validated surface (:class:`LaunchOptions`): it
builds torch's :class:`~torch.distributed.launcher.api.LaunchConfig` and calls
:func:`~torch.distributed.launcher.api.launch_agent`, so rendezvous, restarts, the workers'
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``) and signal forwarding are torch's own.
What it adds:

* **Rendezvous choice.** One node and no ``rdzv_endpoint``: a static rendezvous whose store
  listens on ``master_addr`` only (127.0.0.1 by default), on a port found by binding port 0, so no
  other job can take the port between choosing and using it. Several nodes: torch's ``static``
  rendezvous on ``master_addr:master_port`` with ``node_rank``; or, with ``rdzv_endpoint``, the
  ``c10d`` rendezvous (elastic ``nnodes="MIN:MAX"``, late joiners, restarts across nodes).
* **Attributable output.** Every line a worker prints carries its global rank: ``[rank1]: ...``,
  whole (torch's tail can split a line that two ranks print at once: :mod:`._tail`).
* **One failure report.** Workers run under :mod:`torsh_distributed.elastic._bootstrap`, which
  writes an uncaught exception to torch's per-worker error file instead of printing it. When the
  job fails, one block names the rank that failed first (global and local rank, node, host, exit
  code) with its traceback, and lists any other failed rank on one line each.
* **Restarts said.** With ``max_restarts``, every failure that a restart follows prints one
  line per failed rank (global and local rank, node, host, exit code or signal) and one line
  ``restart k of N``, at every verbosity (:mod:`torsh_distributed.elastic._agent`).
* **A quiet agent.** torch's agent logs (rendezvous details, "Sending process ... closing signal
  SIGTERM", ...) are hidden unless ``verbose=True``.

Trust model. torch's rendezvous store (``TCPStore``) and the Gloo/NCCL transports have neither
authentication nor encryption: whoever reaches the store's port can join the job, read its keys or
corrupt it. ``TCPStore`` listens on *every* interface whatever host name it is given, so for a
single-node job we bind the listening socket ourselves, to ``master_addr`` (loopback unless you
change it), hand it to the store, and point Gloo at the loopback interface (``GLOO_SOCKET_IFNAME``)
unless you set that yourself. A multi-node job must listen where other nodes can reach it, and
torch's stores then bind every interface of node 0 (static) or of the endpoint's host (c10d): run
multi-node jobs only on a trusted, isolated network, never with those ports open to the internet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from torsh_distributed.elastic import _network as _net
from torsh_distributed.elastic import _tail, _warm
from torsh_distributed.elastic._agent import reporting_agent
from torsh_distributed.elastic._bootstrap import run_worker
from torsh_distributed.elastic._options import (
    DEFAULT_C10D_PORT,
    RDZV_BACKENDS,
    RDZV_CONF_KEYS,
    UNREACHABLE_AFTER_S,
    LaunchOptions,
    launch_target,
    parse_nnodes,
)
from torsh_distributed.elastic._rendezvous import LOCAL_BACKEND as _LOCAL_BACKEND
from torsh_distributed.elastic._rendezvous import RDZV_TIMEOUT_S as _RDZV_TIMEOUT_S
from torsh_distributed.elastic._rendezvous import Plan as _Plan
from torsh_distributed.elastic._rendezvous import is_loopback as _is_loopback
from torsh_distributed.elastic._rendezvous import plan as _plan
from torsh_distributed.elastic._report import report_failure as _report
from torsh_distributed.runtime._net import loopback_interface as _loopback_interface
from torsh_distributed.runtime.errors import ProcessFailureError

__all__ = [
    "LaunchOptions", "launch", "RDZV_BACKENDS", "LOG_LINE_PREFIX", "parse_nnodes", "RDZV_CONF_KEYS",
    "UNREACHABLE_AFTER_S",
]

LOG_LINE_PREFIX = "[rank${rank}]: "
"""Prefix of each worker output line (torch's ``log_line_prefix_template``)."""

_BOOTSTRAP = "torsh_distributed.elastic._bootstrap"
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")



def _worker_env(options: LaunchOptions, plan: _Plan) -> dict[str, str]:
    env = dict(options.env)
    if options.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env.setdefault("OMP_NUM_THREADS", "1")
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        if plan.backend == _LOCAL_BACKEND and _is_loopback(options.master_addr):
            lo = _loopback_interface()
            if lo:
                env.setdefault("GLOO_SOCKET_IFNAME", lo)
        elif plan.route is not None:  # several nodes: the interface the master is reached by
            env.setdefault("GLOO_SOCKET_IFNAME", plan.route.interface)
    if plan.route is not None:
        env.setdefault("TORSH_NODE_ADDR", plan.route.local_ip)  # names this node in reports
    if plan.backend == _LOCAL_BACKEND:
        # One node: this launch is the job, and its attempts share this id (the engine carries
        # restarts and lost steps across them; see checkpoint.progress). Several nodes: the
        # rdzv_id every node shares (TORCHELASTIC_RUN_ID) names the job instead.
        env.setdefault("TORSH_JOB_ID", uuid.uuid4().hex[:16])
    if plan.backend == "c10d":
        # torch's c10d rendezvous otherwise keeps ONE workers' store for every round: after a
        # restart or a membership change the new workers read the dead ones' Gloo addresses and
        # fail with "connection refused" (seen on the network lab). With sharing off, rank 0 of
        # every round starts a fresh store, as torch's own comment on restarts assumes.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def _check_network(options: LaunchOptions, plan: _Plan) -> None:
    """Several nodes: find the route to the master, decide who hosts a c10d store, and wait
    (bounded) until the master answers, so a wrong address fails in seconds, naming it."""
    if plan.backend == _LOCAL_BACKEND:
        return
    host, port = parse_rendezvous_endpoint(plan.endpoint, default_port=DEFAULT_C10D_PORT)
    plan.route = route = _net.route_to(host, port)
    hosts_store = _net.is_local(route.master_ip) and (
        plan.backend == "c10d" or options.node_rank == 0
    )
    if plan.backend == "c10d" and "is_host" not in plan.configs:
        # torch decides by host name, which fails where names resolve to loopback (or every
        # node shares one name); the address tells, and a taken port means another agent of
        # this machine hosts it already.
        plan.configs["is_host"] = hosts_store and _net.port_is_free(route.master_ip, port)
    note = options.verbose or (
        _net.hostname_is_loopback() and "GLOO_SOCKET_IFNAME" not in os.environ
    )
    if note:
        print(
            f"torsh-dist: this node reaches the master {route.master_ip} through "
            f"{route.interface} ({route.local_ip}); Gloo uses {route.interface} "
            "(set GLOO_SOCKET_IFNAME to choose another interface)",
            file=sys.stderr,
            flush=True,
        )
    if hosts_store:
        if plan.configs.get("is_host", True):  # c10d: another agent here may host it instead
            print(_hosting_line(options, plan, route.master_ip, port), file=sys.stderr,
                  flush=True)
        return

    def waiting(seconds: float) -> None:
        print(
            f"torsh-dist: waiting for the master's store at {route.master_ip}:{port} "
            f"({seconds:.0f} s; start node 0)",
            file=sys.stderr,
            flush=True,
        )

    _net.wait_for_master(
        route,
        port,
        unreachable_after_s=float(options.master_timeout),
        give_up_after_s=_RDZV_TIMEOUT_S,
        on_wait=waiting,
    )


def _hosting_line(options: LaunchOptions, plan: _Plan, address: str, port: int) -> str:
    """What the node hosting the rendezvous waits for, and how the others join it: otherwise
    it waits up to the rendezvous timeout without a word while no other node is started."""
    if options.rdzv_endpoint is not None:
        join = f"--rdzv-backend {plan.backend} --rdzv-endpoint {address}:{port}"
    else:
        join = f"--master-addr {address} --master-port {port}"
    if plan.backend == "c10d":  # torch's c10d handler waits join_timeout (600 s by default)
        wait = int(float(plan.configs.get("join_timeout", 600)))
        line = (
            f"torsh-dist: this node hosts the rendezvous at {address}:{port} (c10d, "
            f"{options.min_nodes} to {options.max_nodes} nodes, waiting up to {wait} s "
            f"for {options.min_nodes}); other nodes join with the same command and --nnodes "
            f"{options.nnodes} {join}"
        )
    else:
        others = options.max_nodes - 1
        ranks = "1" if others == 1 else f"1 to {others}"
        line = (
            f"torsh-dist: node {options.node_rank} of {options.max_nodes} hosts the rendezvous at "
            f"{address}:{port} and waits up to {int(plan.configs.get('timeout', _RDZV_TIMEOUT_S))} "
            f"s for the other {'node' if others == 1 else f'{others} nodes'}: start "
            f"{'it' if others == 1 else 'them'} with the same command and --node-rank {ranks} "
            f"{join}"
        )
    if _is_loopback(address):
        line += f" ({address}: only nodes on this machine reach it)"
    return line


# --- process-wide state the agent touches -----------------------------------------------------


@contextlib.contextmanager
def _patched_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """The agent passes ``os.environ`` to workers (and writes to it): restore it afterwards."""
    before = dict(os.environ)
    os.environ.update(updates)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def _restored_signal_handlers() -> Iterator[None]:
    """The agent installs handlers that raise ``SignalException``; put ours back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    for name in _HANDLED_SIGNALS:
        if hasattr(signal, name):
            sig = getattr(signal, name)
            saved[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _agent_logging(verbose: bool) -> Iterator[None]:
    """Hide torch's agent logs, or show them at INFO with ``verbose``.

    Records of every logger under the agent's packages stop at the package logger (no
    propagation) and go to its one handler: nothing, or stderr. torch sets explicit levels on
    some child loggers (``LOGLEVEL``, default WARNING), so verbose mode lowers those to INFO.
    """
    handler: logging.Handler
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[torsh-dist agent] %(levelname)s %(message)s"))
    else:
        handler = logging.NullHandler()
    saved: list[tuple[logging.Logger, int, bool]] = []
    for name in _AGENT_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO if verbose else logging.CRITICAL)
    if verbose:
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger) and name.startswith(
                tuple(f"{p}." for p in _AGENT_LOGGERS)
            ):
                saved.append((logger, logger.level, logger.propagate))
                logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level, propagate in saved:
            logger.setLevel(level)
            logger.propagate = propagate
        for name in _AGENT_LOGGERS:
            logging.getLogger(name).removeHandler(handler)


# --- the launch ------------------------------------------------------------------------------


def launch(
    options: LaunchOptions,
    *,
    script: str | None = None,
    module: str | None = None,
    args: Sequence[str] = (),
) -> int:
    """Run ``script`` (or ``module``) on this node's workers, joined with the job's other nodes.

    Blocks until the job ends. Worker output goes to this process's stdout/stderr, each line
    prefixed with ``[rank<N>]:``. On failure one report on stderr names the root-cause rank and
    shows its traceback once.

    Args:
        options: Processes, nodes, rendezvous, restarts and logs.
        script: Path of a Python file, run as ``python SCRIPT ARGS...`` in every worker.
        module: Module name, run as ``python -m MODULE ARGS...``; exclusive with ``script``.
        args: Arguments for the script or module (``sys.argv[1:]`` in the workers).

    Returns:
        0 when every worker succeeded. After a failure: the failed worker's exit code when one
        worker failed on its own (others failing only because it vanished do not count; a signal
        N gives 128 + N), else 1. 128 + N when this launcher was stopped by signal N (Ctrl-C:
        130); the workers are stopped first.

    Raises:
        TypeError / ValueError: bad arguments (both or neither of ``script`` and ``module``, a
            script that is not a file), raised before anything starts.
        ConfigurationError: the store cannot listen on ``master_addr:master_port``.
        ProcessFailureError: the rendezvous failed (a node never came, endpoint unreachable).
    """
    if not isinstance(options, LaunchOptions):
        raise TypeError(f"options must be a LaunchOptions, got {type(options).__name__}")
    target = launch_target(script, module, args)

    plan = _plan(options)
    _check_network(options, plan)
    _tail.install()  # whole lines only in the prefixed output (torch's tail can split one)
    own_log_dir = options.log_dir is None
    log_dir = tempfile.mkdtemp(prefix="torsh-run-") if own_log_dir else str(options.log_dir)
    try:
        ranks_filter = options.local_ranks_filter
        logs_specs = DefaultLogsSpecs(
            log_dir=log_dir,
            tee=Std.ALL,  # tee = write to the log file and echo it with the rank prefix
            local_ranks_filter=set(ranks_filter) if ranks_filter else None,
        )
        config = LaunchConfig(
            min_nodes=options.min_nodes,
            max_nodes=options.max_nodes,
            nproc_per_node=options.nproc_per_node,
            logs_specs=logs_specs,
            run_id=options.rdzv_id,
            role="default",
            rdzv_endpoint=plan.endpoint,
            rdzv_backend=plan.backend,
            rdzv_configs=plan.configs,
            max_restarts=options.max_restarts,
            monitor_interval=options.monitor_interval,
            log_line_prefix_template=LOG_LINE_PREFIX,
            start_method="forkserver",  # used only for a function entry point (warm start)
            # the address peers reach this node at (torch would resolve the host name, which
            # may be loopback): where node 0 runs the workers' store, and what it publishes
            local_addr=plan.route.local_ip if plan.route is not None else None,
        )
        warm = options.start_method == "forkserver" and "PYTHON_EXEC" not in os.environ
        if warm:  # usually already started by the CLI, before it imported torch
            _warm.prestart(_warm.preload_for(module))
        if options.verbose:
            print(
                f"torsh-dist: {options.nproc_per_node} worker(s) on this node, nnodes "
                f"{options.nnodes}, rendezvous {plan.backend} at {plan.endpoint}, logs in {log_dir}",
                file=sys.stderr,
                flush=True,
            )
        with (
            _agent_logging(options.verbose),
            _patched_environ(_worker_env(options, plan)),
            _restored_signal_handlers(),
            reporting_agent(sys.stderr),
        ):
            try:
                if warm:  # what the agent gives a function: see _warm
                    entry: Any = run_worker
                    cmd_args: list[Any] = [dict(os.environ), os.getcwd(), [*target, *args]]
                else:
                    entry = os.environ.get("PYTHON_EXEC", sys.executable)
                    cmd_args = ["-u", "-m", _BOOTSTRAP, *target, *args]
                launch_agent(config, entry, cmd_args)
            except ChildFailedError as exc:
                return _report(
                    exc,
                    node=None if plan.backend == "c10d" else options.node_rank,
                    log_dir=None if own_log_dir else log_dir,
                    out=sys.stderr,
                )
            except SignalException as exc:
                print(
                    f"torsh-dist: received {exc.sigval.name}; all workers were stopped",
                    file=sys.stderr,
                    flush=True,
                )
                return 128 + int(exc.sigval)
            except (RendezvousError, dist.DistError) as exc:
                raise ProcessFailureError(
                    f"rendezvous failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                    operation="rendezvous",
                    fix="check that every node runs the same --nnodes, --rdzv-id and endpoint "
                    "(--master-addr/--master-port or --rdzv-endpoint) and can reach it.",
                ) from exc
        return 0
    finally:
        if plan.listener is not None and plan.listener.fileno() != -1:
            plan.listener.close()  # never handed to a store (the agent failed before rendezvous)
        if own_log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
