"""``torsh-dist``: one command line for launching, training and inspecting jobs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torsh_distributed import __version__
from torsh_distributed.runtime.errors import TorshDistributedError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torsh-dist",
        description="torsh-distributed: launch and train PyTorch models across processes and hosts.",
    )
    parser.add_argument("--version", action="version", version=f"torsh-dist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    from torsh_distributed.cli import run as run_cmd
    from torsh_distributed.cli import train as train_cmd

    run_cmd.register(sub)
    from torsh_distributed.cli import checkpoint as checkpoint_cmd

    checkpoint_cmd.register(sub)
    train_cmd.register(sub)
    __import__("torsh_distributed.cli.bench", fromlist=["register"]).register(sub)
    __import__("torsh_distributed.cli.plan", fromlist=["register"]).register(sub)
    __import__("torsh_distributed.cli.generate", fromlist=["register"]).register(sub)
    __import__("torsh_distributed.cli.infer", fromlist=["register"]).register(sub)
    __import__("torsh_distributed.cli.horovodrun", fromlist=["register"]).register(sub)
    __import__("torsh_distributed.cli.serve", fromlist=["register"]).register(sub)
    __import__("torsh_distributed.cli.slurm", fromlist=["register"]).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``torsh-dist``; user errors print one line and exit 2 instead of a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, TorshDistributedError) as exc:
        print(f"torsh-dist {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
