"""CPU-burning neighbours for the benchmarks' busy-host runs: ``--burners-per-core B`` starts
``B x cores`` busy-loop processes for the whole measurement (users' hosts are busy)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--burners-per-core B`` (default 0: quiet)."""
    parser.add_argument(
        "--burners-per-core",
        type=int,
        default=0,
        help="CPU-burning neighbour processes per core during the runs (default 0: quiet)",
    )


@contextlib.contextmanager
def burning(per_core: int) -> Iterator[int]:
    """Run ``per_core`` busy loops per core while the block runs; yields how many were started.
    They are killed and reaped on the way out, whatever happens in the block."""
    if per_core < 0:
        raise ValueError(f"--burners-per-core must be >= 0, got {per_core}")
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(per_core * (os.cpu_count() or 1))
    ]
    try:
        yield len(procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
