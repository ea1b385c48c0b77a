"""``torsh-dist``: one command line for launching, training and inspecting jobs."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from collections.abc import Sequence

from torsh_distributed import __version__
from torsh_distributed.cli._config_file import apply_config_file, print_config
from torsh_distributed.runtime.errors import TorshDistributedError

_COMMANDS = {
    "run": "torsh_distributed.cli.run",
    "checkpoint": "torsh_distributed.cli.checkpoint",
    "train": "torsh_distributed.cli.train",
    "bench": "torsh_distributed.cli.bench",
    "plan": "torsh_distributed.cli.plan",
    "generate": "torsh_distributed.cli.generate",
    "infer": "torsh_distributed.cli.infer",
    "horovodrun": "torsh_distributed.cli.horovodrun",
    "serve": "torsh_distributed.cli.serve",
    "slurm": "torsh_distributed.cli.slurm",
    "energy": "torsh_distributed.cli.energy",
    "doctor": "torsh_distributed.cli.doctor",
    "federated": "torsh_distributed.cli.federated",
    "federated-node": "torsh_distributed.cli.federated",  # registered with federated
}
"""Subcommand -> the module whose ``register(subparsers)`` adds it, in ``--help`` order."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``torsh-dist`` parser with every subcommand, or with ``only`` that one.

    Registering a subcommand imports its module, and some import the trainer and the engine
    (~1.5 s): :func:`main` registers just the command it runs.
    """
    parser = argparse.ArgumentParser(
        prog="torsh-dist",
        description="torsh-distributed: launch and train PyTorch models across processes and hosts.",
    )
    parser.add_argument("--version", action="version", version=f"torsh-dist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    registered: set[str] = set()
    for name, module in _COMMANDS.items():
        if (only is None or name == only) and module not in registered:
            importlib.import_module(module).register(sub)  # may add several commands
            registered.add(module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``torsh-dist``; user errors print one line and exit 2 instead of a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in _COMMANDS else None)
    if command in _COMMANDS:
        try:
            apply_config_file(parser, argv, command)  # --config FILE: the file's settings as defaults
        except ValueError as exc:
            print(f"torsh-dist {command}: error: {exc}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    try:
        if getattr(args, "print_config", False):
            return print_config(args)
        return int(args.handler(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, TorshDistributedError) as exc:
        print(f"torsh-dist {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The ``torsh-dist`` console script: :func:`main`, then exit without collecting the
    interpreter's objects one by one. With torch imported, the final garbage collection of a
    process's module objects takes 0.8-1 s on the 2-core VM (0.2 s frozen); every command pays
    it, and the shell waits for it. Files are closed by the commands themselves; ``atexit``
    handlers still run."""
    # before anything imports torch: on a busy host OpenMP's idle threads sleep instead of
    # spinning, here and in every process this command starts, unless the user chose
    # (runtime/_omp_wait.py)
    from torsh_distributed.elastic import _warm
    from torsh_distributed.runtime import _omp_wait  # noqa: F401

    _warm.allow_fork()  # this process is the command: its workers' forkserver may fork from it
    code = main()
    gc.freeze()  # the process ends next: leave its objects to the OS
    sys.exit(code)


if __name__ == "__main__":
    entry()
