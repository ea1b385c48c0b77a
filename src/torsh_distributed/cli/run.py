"""``torsh-dist run``: start a script or module on N processes per node (torchrun-compatible).

The flags are torchrun's (``--nproc-per-node``/``--nproc_per_node``, ``--nnodes``,
``--node-rank``, ``--master-addr``, ``--master-port``, ``--rdzv-endpoint``, ``--rdzv-backend``,
``--rdzv-id``, ``--max-restarts``, ``--log-dir``, ``-m``); :func:`add_launch_arguments` adds them
to any parser (``torsh-dist train`` reuses them) and :func:`options_from_args` turns them into
:class:`~torsh_distributed.elastic.launch.LaunchOptions`.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from torsh_distributed.elastic._options import UNREACHABLE_AFTER_S, LaunchOptions, launch_target
from torsh_distributed.elastic._warm import START_METHODS
from torsh_distributed.runtime.errors import TorshDistributedError

__all__ = ["add_launch_arguments", "options_from_args", "register"]

_EPILOG = """\
examples:
  # one node, 2 processes; --lr 1e-3 goes to train.py
  torsh-dist run --nproc-per-node 2 train.py --lr 1e-3

  # a module instead of a script (like python -m)
  torsh-dist run --nproc-per-node 4 -m mypkg.train --epochs 3

  # two nodes, static rendezvous on node 0 (10.0.0.1); run on each node with its --node-rank
  torsh-dist run --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
      --master-addr 10.0.0.1 --master-port 29500 train.py      # on node 0
  torsh-dist run --nnodes 2 --node-rank 1 --nproc-per-node 8 \\
      --master-addr 10.0.0.1 --master-port 29500 train.py      # on node 1

  # elastic: start with 1 node, admit a 2nd when it comes, restart up to 3 times on failure
  torsh-dist run --nnodes 1:2 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job42 --max-restarts 3 train.py

Workers see torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...), so torch.distributed's env://
init and torsh_distributed.init() work unchanged. Output lines are prefixed [rank<N>]:; a
failure prints the failing rank's traceback once and exits non-zero.

Security: torch's rendezvous store has no authentication. A single-node job listens on
127.0.0.1 only; a multi-node job listens on all interfaces of node 0 (or of the rendezvous
host): run multi-node jobs only on a trusted network.
"""


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add torchrun-compatible launch flags (both ``--dash-names`` and ``--underscore_names``)."""
    group = parser.add_argument_group("launch (torchrun-compatible)")
    group.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        default="1",
        metavar="N",
        help="worker processes on this node: an integer, 'gpu' (one per CUDA device), 'cpu' "
        "(one per core) or 'auto' (gpu if any, else cpu). Default: 1",
    )
    group.add_argument(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="number of nodes; MIN:MAX makes the job elastic (needs --rdzv-endpoint): it starts "
        "with MIN nodes and admits up to MAX. Default: 1",
    )
    group.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=0,
        metavar="K",
        help="this node's index in [0, nnodes) for the static rendezvous (--master-addr); the c10d "
        "rendezvous numbers nodes itself. Default: 0",
    )
    group.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default="127.0.0.1",
        metavar="HOST",
        help="static rendezvous: address of node 0, the same on every node. On one node it is "
        "the only address the store listens on. Default: 127.0.0.1",
    )
    group.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=int,
        default=None,
        metavar="PORT",
        help="static rendezvous port. Default: a free port on one node, 29500 on several",
    )
    group.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        default=None,
        metavar="HOST[:PORT]",
        help="rendezvous endpoint for --rdzv-backend (c10d port default 29400); the node whose "
        "host name matches runs the store. Overrides --master-addr/--master-port",
    )
    group.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        default="c10d",
        choices=("c10d", "static"),
        help="rendezvous used with --rdzv-endpoint: c10d (elastic) or static (fixed nodes, "
        "--node-rank). Default: c10d",
    )
    group.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        default=None,
        metavar="KEY=VALUE,...",
        help="c10d rendezvous settings in seconds, e.g. last_call_timeout=5 (how long an elastic "
        "job waits for more nodes once MIN joined; default 30), join_timeout, close_timeout, "
        "read_timeout, keep_alive_interval, keep_alive_max_attempt",
    )
    group.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        dest="rdzv_id",
        default="torsh",
        metavar="ID",
        help="job id, the same on every node; distinct for jobs sharing an endpoint. "
        "Default: torsh",
    )
    group.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart all workers up to K times after a failure (workers read "
        "TORCHELASTIC_RESTART_COUNT to resume). Default: 0",
    )
    group.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        dest="monitor_interval",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="how often the agent checks its workers. Default: 0.1",
    )
    group.add_argument(
        "--start-method",
        "--start_method",
        dest="start_method",
        choices=START_METHODS,
        default="forkserver",
        help="how workers start: forkserver = forked from one process that imported torch once, "
        "started while the launcher checks and rendezvouses (saves each worker and each restart "
        "the import; with --ft.replica-groups, every restarted group too); spawn = a fresh "
        "`python -u -m ...` per worker, as torchrun starts scripts. Default: forkserver",
    )
    group.add_argument(
        "--master-timeout",
        "--master_timeout",
        dest="master_timeout",
        type=float,
        default=UNREACHABLE_AFTER_S,
        metavar="SECONDS",
        help="several nodes: give up when the master's address (--master-addr or "
        "--rdzv-endpoint) does not answer at all for this long (wrong address, firewall); "
        "'connection refused' (node 0 not up yet) is waited for. "
        f"Default: {UNREACHABLE_AFTER_S:g}",
    )
    group.add_argument(
        "--log-dir",
        "--log_dir",
        dest="log_dir",
        default=None,
        metavar="DIR",
        help="keep each worker's stdout.log, stderr.log and error.json under DIR (the console "
        "shows the same). Default: a temporary directory, removed at the end",
    )
    group.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        dest="local_ranks_filter",
        default=None,
        metavar="R,R,...",
        help="show only these local ranks' output on the console (all still go to --log-dir)",
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show torch's elastic agent logs (rendezvous, restarts, signals)",
    )


def _resolve_nproc(value: object) -> int:
    text = str(value).strip().lower()
    if text in ("gpu", "cpu", "auto"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu" and gpus == 0:
            raise ValueError("nproc_per_node='gpu' needs CUDA, but no CUDA device is visible")
        if text == "gpu" or (text == "auto" and gpus > 0):
            return gpus
        return os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"nproc_per_node must be an integer, 'gpu', 'cpu' or 'auto', got {value!r}"
        ) from None


def _resolve_filter(value: object) -> frozenset[int] | None:
    if value is None or value == "":
        return None
    try:
        return frozenset(int(part) for part in str(value).split(",") if part.strip())
    except ValueError:
        raise ValueError(
            f"local_ranks_filter must be comma-separated local ranks like 0,1, got {value!r}"
        ) from None


def _resolve_rdzv_conf(value: object) -> dict[str, str]:
    if value is None or value == "":
        return {}
    conf = {}
    for part in str(value).split(","):
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"rdzv_conf must be KEY=VALUE pairs separated by commas, got {value!r}")
        conf[key.strip()] = val.strip()
    return conf


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    """The :class:`LaunchOptions` named by the flags of :func:`add_launch_arguments`.

    Raises:
        ValueError: a flag has a bad value (the message names the field).
    """
    return LaunchOptions(
        nproc_per_node=_resolve_nproc(args.nproc_per_node),
        nnodes=str(args.nnodes),
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_conf=_resolve_rdzv_conf(getattr(args, "rdzv_conf", None)),
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        master_timeout=args.master_timeout,
        log_dir=args.log_dir,
        local_ranks_filter=_resolve_filter(args.local_ranks_filter),
        verbose=bool(args.verbose),
        start_method=getattr(args, "start_method", "forkserver"),
    )


def _handle(args: argparse.Namespace) -> int:
    if args.script is None:
        print(
            "torsh-dist run: error: name a SCRIPT to run, or -m MODULE "
            "(usage: torsh-dist run [options] (SCRIPT | -m MODULE) [ARGS ...])",
            file=sys.stderr,
        )
        return 2
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            options = options_from_args(args)
        # a missing script is refused before the forkserver below imports torch
        launch_target(None if args.module else args.script, args.script if args.module else None, args.script_args)
        for warning in caught:
            print(f"torsh-dist run: warning: {warning.message}", file=sys.stderr)
        if options.start_method == "forkserver" and "PYTHON_EXEC" not in os.environ:
            from torsh_distributed.elastic import _warm

            # the workers' forkserver, forked from this process once it has imported torch
            # (the CLI holds nothing else yet): torch is imported once for the whole launch
            _warm.prestart(_warm.preload_for(args.script if args.module else None), fork=True)
        from torsh_distributed.elastic.launch import launch  # torch's agent: after the checks

        if args.module:
            return launch(options, module=args.script, args=args.script_args)
        return launch(options, script=args.script, args=args.script_args)
    except (ValueError, TypeError) as exc:
        print(f"torsh-dist run: error: {exc}", file=sys.stderr)
        return 2
    except TorshDistributedError as exc:
        print(f"torsh-dist run: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("torsh-dist run: interrupted", file=sys.stderr)
        return 130


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand."""
    parser = subparsers.add_parser(
        "run",
        help="run a script or module on N processes per node (torchrun-compatible)",
        description=(
            "Start SCRIPT (or -m MODULE) on --nproc-per-node processes on this node, joined with "
            "the job's other nodes through torch's elastic agent. Everything after SCRIPT or "
            "MODULE is passed to it unchanged."
        ),
        usage="torsh-dist run [options] (SCRIPT | -m MODULE) [ARGS ...]",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_arguments(parser)
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="treat SCRIPT as a module name and run it like `python -m MODULE` (torchrun's -m)",
    )
    parser.add_argument(
        "script", nargs="?", metavar="SCRIPT", help="Python file to run (or MODULE with -m)"
    )
    parser.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments for SCRIPT/MODULE, passed through unchanged",
    )
    parser.set_defaults(handler=_handle)
