"""Start-to-first-step of the built-in trainer under Open MPI's ``mpirun -np 2``.

Start is ``time.time()`` right before ``mpirun`` is spawned; the first step is the trainer's own
``first_step_unix_s`` (summary JSON), so the figure covers mpirun's start-up, Python and torch
imports on both ranks, the rendezvous derived without ``MASTER_ADDR`` (mpi4py when installed,
see docs/mpi.md) and the first optimizer step. Same clock on one machine: the ranks are local.

    .venv/bin/python benchmarks/launchers/mpi.py [--max-steps 5] [--repeat 3]

``OMP_NUM_THREADS`` defaults to 1 per rank, as ``torsh-dist run`` sets it for several local ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_STRIPPED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def mpirun_command(np: int = 2) -> list[str]:
    """``mpirun -np N`` with the flags this machine needs (root, more ranks than cores)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError("mpirun is not installed (Open MPI: apt-get install openmpi-bin)")
    cmd = [mpirun, "-np", str(np), "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def _torsh_dist() -> str:
    beside = Path(sys.executable).with_name("torsh-dist")
    found = str(beside) if beside.exists() else shutil.which("torsh-dist")
    if found is None:
        raise FileNotFoundError("torsh-dist is not installed in this environment")
    return found


def time_to_first_step(workdir: Path, *, max_steps: int = 5) -> dict:
    """Run ``mpirun -np 2 torsh-dist train --preset tiny`` once and time its first step.

    Args:
        workdir: Where the summary JSON and checkpoints go (created if missing).
        max_steps: Steps to train; only the first one is timed, more only lengthen the run.

    Returns:
        ``{"launcher": "mpirun", "start_to_first_step_s": ..., "final_loss": ...}``.

    Raises:
        RuntimeError: the run failed (its output is in the message).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    summary = workdir / "mpi_summary.json"
    summary.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _STRIPPED and not k.startswith("SLURM_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        *mpirun_command(2), "-x", "OMP_NUM_THREADS",
        _torsh_dist(), "train", "--preset", "tiny", "--max-steps", str(max_steps),
        "--progress", "false", "--summary-json", str(summary),
        "--checkpoint-dir", str(workdir / "checkpoints"), "--resume", "never",
    ]
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not summary.exists():
        raise RuntimeError(f"mpirun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(summary.read_text())
    return {
        "launcher": "mpirun",
        "start_to_first_step_s": result["first_step_unix_s"] - start,
        "final_loss": result["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1, help="runs; each is printed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            print(json.dumps(time_to_first_step(Path(tmp) / str(i), max_steps=args.max_steps)))


if __name__ == "__main__":
    main()
