"""``torsh-dist horovodrun``: Horovod's launcher command on this host, through ``torsh-dist run``.

Parses horovodrun's flags, lets :func:`torsh_distributed.compat.horovod._runner.plan_horovodrun`
map them onto :class:`~torsh_distributed.elastic.launch.LaunchOptions`, and launches.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import textwrap

from torsh_distributed.compat.horovod._runner import plan_horovodrun
from torsh_distributed.elastic._options import launch_target
from torsh_distributed.runtime.errors import TorshDistributedError

__all__ = ["register"]

_EPILOG = """\
examples:
  # 2 processes on this host; the script imports torsh_distributed.compat.horovod.torch as hvd
  torsh-dist horovodrun -np 2 python train.py --epochs 3
  torsh-dist horovodrun -np 4 -H localhost:4 python train.py

  # elastic (hvd.elastic.run + TorchState): restart every worker up to 3 times after a failure;
  # each restart resumes from the last state.commit()
  torsh-dist horovodrun -np 2 --reset-limit 3 python train_elastic.py

Only this host is launched (no ssh): -H / --hostfile naming other hosts prints the
`torsh-dist run` command to start on each host. Workers see torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, ...), not HOROVOD_*; hvd.init() reads them. Each job gets a private
directory for elastic commits (TORSH_HOROVOD_ELASTIC_DIR), removed when the job ends.
Horovod's tuning flags of its own engine (--fusion-threshold-mb, --cycle-time-ms, ...) are
accepted and reported as having no effect. See docs/horovod.md.
"""

_TUNING = (
    ("--fusion-threshold-mb", "MB"),
    ("--cycle-time-ms", "MS"),
    ("--cache-capacity", "N"),
    ("--timeline-filename", "FILE"),
    ("--start-timeout", "SECONDS"),
    ("-p", "PORT"),
    ("--ssh-port", "PORT"),
    ("-i", "FILE"),
    ("--ssh-identity-file", "FILE"),
)
_TUNING_SWITCHES = (
    "--hierarchical-allreduce",
    "--hierarchical-allgather",
    "--autotune",
    "--timeline-mark-cycles",
    "--no-stall-check",
    "--disable-cache",
    "--gloo",
)


def _flag_dest(flag: str) -> str:
    return "ignored_" + flag.lstrip("-").replace("-", "_")


def _handle(args: argparse.Namespace) -> int:
    if args.mpi:
        print(
            "torsh-dist horovodrun: error: --mpi is not supported: workers communicate through "
            "torch.distributed (Gloo on CPU, NCCL on GPUs); drop --mpi",
            file=sys.stderr,
        )
        return 2
    ignored = [flag for flag, _ in _TUNING if getattr(args, _flag_dest(flag)) is not None]
    ignored += [
        flag for flag in _TUNING_SWITCHES if flag != "--gloo" and getattr(args, _flag_dest(flag))
    ]
    elastic_dir = tempfile.mkdtemp(prefix="torsh-hvd-elastic-")
    try:
        try:
            plan = plan_horovodrun(
                np=args.num_proc,
                hosts=args.hosts,
                hostfile=args.hostfile,
                command=args.command,
                min_np=args.min_np,
                max_np=args.max_np,
                reset_limit=args.reset_limit,
                max_restarts=args.max_restarts,
                host_discovery_script=args.host_discovery_script,
                network_interface=args.network_interface,
                output_filename=args.output_filename,
                verbose=args.verbose,
                ignored=ignored,
                elastic_dir=elastic_dir,
            )
            launch_target(plan.script, plan.module, plan.args)  # a missing script: before torch
        except (ValueError, FileNotFoundError) as exc:
            print(f"torsh-dist horovodrun: error: {exc}", file=sys.stderr)
            return 2
        for note in plan.notes:
            print(f"torsh-dist horovodrun: warning: {note}", file=sys.stderr)
        from torsh_distributed.elastic.launch import launch  # torch's agent: after the checks

        try:
            if plan.module is not None:
                return launch(plan.options, module=plan.module, args=plan.args)
            return launch(plan.options, script=plan.script, args=plan.args)
        except (ValueError, TypeError) as exc:
            print(f"torsh-dist horovodrun: error: {exc}", file=sys.stderr)
            return 2
        except TorshDistributedError as exc:
            print(f"torsh-dist horovodrun: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("torsh-dist horovodrun: interrupted", file=sys.stderr)
            return 130
    finally:
        shutil.rmtree(elastic_dir, ignore_errors=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``horovodrun`` subcommand."""
    parser = subparsers.add_parser(
        "horovodrun",
        help="run a Horovod script on this host (horovodrun-compatible flags)",
        description=(
            "Start COMMAND (`python SCRIPT ...` or `python -m MODULE ...`) on -np processes on "
            "this host, like Horovod's horovodrun, through the torsh-dist run launcher."
        ),
        usage="torsh-dist horovodrun -np N [-H HOST:SLOTS] [options] COMMAND ...",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        required=True,
        metavar="N",
        help="number of worker processes",
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H",
        "--hosts",
        default=None,
        metavar="HOST:SLOTS[,...]",
        help="hosts and their slots; only this host (localhost:N) can be launched here",
    )
    hosts.add_argument(
        "-hostfile",
        "--hostfile",
        dest="hostfile",
        default=None,
        metavar="FILE",
        help="Horovod host file (`HOST slots=N` per line); only this host",
    )
    parser.add_argument(
        "--network-interface",
        "--network-interfaces",
        dest="network_interface",
        default=None,
        metavar="IFACE",
        help="network interface for Gloo/NCCL (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)",
    )
    parser.add_argument(
        "--output-filename",
        dest="output_filename",
        default=None,
        metavar="DIR",
        help="keep each worker's stdout/stderr logs under DIR (the console shows them too)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the launcher agent's logs")
    parser.add_argument(
        "--mpi",
        action="store_true",
        help="refused: there is no MPI transport here",
    )
    elastic = parser.add_argument_group("elastic (hvd.elastic.run)")
    elastic.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_np",
        type=int,
        default=None,
        metavar="N",
        help="Horovod's elastic lower bound; on one host the world stays at -np. Giving it "
        "(or --max-np) makes the job elastic: 3 restarts unless --reset-limit says otherwise",
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_np",
        type=int,
        default=None,
        metavar="N",
        help="Horovod's elastic upper bound (see --min-np)",
    )
    elastic.add_argument(
        "--reset-limit",
        dest="reset_limit",
        type=int,
        default=None,
        metavar="K",
        help="restart all workers up to K times after a failure (torsh-dist run's --max-restarts)",
    )
    elastic.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=int,
        default=None,
        metavar="K",
        help="the same as --reset-limit. Default: 0, or 3 with --min-np/--max-np",
    )
    elastic.add_argument(
        "--host-discovery-script",
        dest="host_discovery_script",
        default=None,
        metavar="SCRIPT",
        help="refused: use torsh-dist run --nnodes MIN:MAX --rdzv-endpoint on each node",
    )
    tuning = parser.add_argument_group(
        "Horovod engine tuning (accepted; no effect here, reported as a warning)"
    )
    for flag, metavar in _TUNING:
        tuning.add_argument(
            flag, dest=_flag_dest(flag), default=None, metavar=metavar, help=argparse.SUPPRESS
        )
    for flag in _TUNING_SWITCHES:
        tuning.add_argument(
            flag, dest=_flag_dest(flag), action="store_true", help=argparse.SUPPRESS
        )
    tuning.description = "\n".join(
        textwrap.wrap(
            "accepted: "
            + ", ".join([flag for flag, _ in _TUNING] + list(_TUNING_SWITCHES))
            + " (--gloo is what happens anyway; the others have no effect here)",
            width=92,
            break_on_hyphens=False,
        )
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="`python SCRIPT [ARGS]` or `python -m MODULE [ARGS]` (or SCRIPT.py [ARGS])",
    )
    parser.set_defaults(handler=_handle)
