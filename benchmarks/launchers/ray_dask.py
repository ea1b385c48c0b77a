"""Start-to-first-step of the built-in trainer under ``launch.ray`` and ``launch.dask`` (2 ranks).

Start is ``time.time()`` right before the launcher is called with no cluster running, so the
figure covers starting the cluster (Ray's head and raylet; Dask's scheduler and two nanny-run
worker processes), the worker processes' Python, torch and trainer imports, the rendezvous on a
kernel-chosen port and the first optimizer step; the first step is the trainer's own
``first_step_unix_s`` (the later of the two ranks). The driver's own imports happen before the
start, as a Python caller's would. Same clock: the cluster is this one host.

    .venv/bin/python benchmarks/launchers/ray_dask.py [--kind ray|dask|both] [--max-steps 5]
        [--repeat 3]

The config is ``torsh-dist train --preset tiny --max-steps N --progress false --checkpoint-dir
DIR --resume never``, as in the other launchers' benchmarks; Ray's actors (one CPU each) and
Dask's nanny-run workers both run with ``OMP_NUM_THREADS=1``, as ``torsh-dist run`` sets it for
several local ranks.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS = ("ray", "dask")


def _config(workdir: Path, max_steps: int) -> Any:
    from torsh_distributed.cli.train import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = [
        "--preset", "tiny", "--max-steps", str(max_steps), "--progress", "false",
        "--summary-json", str(workdir / "summary.json"),
        "--checkpoint-dir", str(workdir / "checkpoints"), "--resume", "never",
    ]  # fmt: skip
    return config_from_args(parser.parse_args(flags))


def time_to_first_step(kind: str, workdir: Path, *, max_steps: int = 5) -> dict:
    """Start a local cluster of ``kind``, train the tiny preset on 2 ranks, time the first step.

    Args:
        kind: ``"ray"`` or ``"dask"``.
        workdir: Where the summary JSON and checkpoints go (created if missing).
        max_steps: Steps to train; only the first one is timed, more only lengthen the run.

    Returns:
        ``{"launcher": kind, "start_to_first_step_s": ..., "final_loss": ...}``.

    Raises:
        ValueError: unknown ``kind``.
        RuntimeError: Ray is already initialised in this process (its start would not count).
        ImportError: Ray or Dask is not installed.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    from torsh_distributed import launch
    from torsh_distributed.train.trainer import train

    if kind == "ray":
        import ray

        if ray.is_initialized():
            raise RuntimeError("Ray is already running in this process: its start would not count")
    workdir.mkdir(parents=True, exist_ok=True)
    config = _config(workdir, max_steps)
    launcher = launch.ray if kind == "ray" else launch.dask
    start = time.time()
    results = launcher(train, num_workers=2, args=(config,), timeout_s=300)
    return {
        "launcher": kind,
        "start_to_first_step_s": max(r.first_step_unix_s for r in results) - start,
        "final_loss": results[0].final_loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=[*KINDS, "both"], default="both")
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each kind; each is printed")
    args = parser.parse_args()
    kinds = KINDS if args.kind == "both" else (args.kind,)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for kind in kinds:
                workdir = Path(tmp) / f"{kind}{i}"
                print(json.dumps(time_to_first_step(kind, workdir, max_steps=args.max_steps)))


if __name__ == "__main__":
    main()
