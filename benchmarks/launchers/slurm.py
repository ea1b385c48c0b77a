"""Start-to-first-step of the built-in trainer under Slurm's ``srun -n 2``.

Start is ``time.time()`` right before ``srun`` is spawned; the first step is the trainer's own
``first_step_unix_s`` (summary JSON), so the figure covers srun's allocation and step launch
(slurmctld -> slurmd -> slurmstepd), Python and torch imports on both ranks, the rendezvous
derived from ``SLURM_*`` (first host of the step, port from the job id) and the first optimizer
step. Same clock: the cluster is this one host.

    .venv/bin/python benchmarks/launchers/slurm.py [--max-steps 5] [--repeat 3]

Run as root: it starts a private single-host cluster (munged, slurmctld, slurmd) with
:func:`torsh_distributed.testing.slurm_cluster.slurm_cluster`, the same code the integration
tests use, and stops it afterwards. ``OMP_NUM_THREADS`` defaults to 1 per rank, as for
``torsh-dist run`` with several local ranks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

_STRIPPED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _torsh_dist() -> str:
    beside = Path(sys.executable).with_name("torsh-dist")
    found = str(beside) if beside.exists() else shutil.which("torsh-dist")
    if found is None:
        raise FileNotFoundError("torsh-dist is not installed in this environment")
    return found


def time_to_first_step(env: Mapping[str, str], workdir: Path, *, max_steps: int = 5) -> dict:
    """Run ``srun -n 2 torsh-dist train --preset tiny`` once on a running cluster and time it.

    Args:
        env: The cluster's client environment (``SLURM_CONF`` pointing at it), e.g.
            :attr:`SlurmCluster.env <torsh_distributed.testing.slurm_cluster.SlurmCluster.env>`.
        workdir: Where the summary JSON and checkpoints go (created if missing).
        max_steps: Steps to train; only the first one is timed, more only lengthen the run.

    Returns:
        ``{"launcher": "slurm (srun)", "start_to_first_step_s": ..., "final_loss": ...}``.

    Raises:
        RuntimeError: the run failed (its output is in the message).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    summary = workdir / "slurm_summary.json"
    summary.unlink(missing_ok=True)
    run_env = {k: v for k, v in env.items() if k not in _STRIPPED}
    run_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        "srun", "-n", "2", "--kill-on-bad-exit=1",
        _torsh_dist(), "train", "--preset", "tiny", "--max-steps", str(max_steps),
        "--progress", "false", "--summary-json", str(summary),
        "--checkpoint-dir", str(workdir / "checkpoints"), "--resume", "never",
    ]
    start = time.time()
    proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not summary.exists():
        raise RuntimeError(f"srun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(summary.read_text())
    return {
        "launcher": "slurm (srun)",
        "start_to_first_step_s": result["first_step_unix_s"] - start,
        "final_loss": result["final_loss"],
    }


def main() -> None:
    from torsh_distributed.testing.slurm_cluster import slurm_cluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1, help="runs; each is printed")
    args = parser.parse_args()
    with slurm_cluster() as cluster, tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            result = time_to_first_step(cluster.env, Path(tmp) / str(i), max_steps=args.max_steps)
            print(json.dumps(result))


if __name__ == "__main__":
    main()
