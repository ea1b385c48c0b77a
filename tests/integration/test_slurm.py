"""A real single-host Slurm cluster (slurmctld + slurmd + munged, started here) runs torsh-dist.

The same 2-rank training under ``srun -n 2``, under an ``sbatch`` script written by
``torsh-dist slurm`` (both modes) and under ``torsh-dist train --nproc-per-node 2`` must reach
the same loss.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from _launch_common import FLAGS, reference_summary  # noqa: E402

from torsh_distributed.runtime.env import SlurmEnvironment
from torsh_distributed.testing.slurm_cluster import (
    SlurmCluster,
    SlurmUnavailableError,
    slurm_cluster,
)

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
TORSH_DIST = str(BIN / "torsh-dist")
TRAIN_FLAGS = [*FLAGS, "--resume", "never"]  # the reference: _launch_common.reference_summary

ALL_REDUCE = """\
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torsh_distributed.runtime import init, shutdown

rt = init(timeout=60)
value = torch.tensor([float(rt.rank + 1)])
dist.all_reduce(value)
info = rt.info
# one file per rank: srun merges the ranks' stdout, where lines could interleave
Path(sys.argv[1], f"{info.rank}.json").write_text(json.dumps({"rank": info.rank, "world": info.world_size, "local_rank": info.local_rank,
                  "local_world": info.local_world_size, "source": info.source,
                  "master": [info.master_addr, info.master_port], "sum": value.item(),
                  "job": int(os.environ["SLURM_JOB_ID"])}))
shutdown()
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with contextlib.ExitStack() as stack:
        try:
            running = stack.enter_context(slurm_cluster())
        except SlurmUnavailableError as exc:
            pytest.skip(str(exc))
        yield running


def _env(base: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                       "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `torsh-dist` inside batch scripts
    return env


def _summary(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reference() -> dict:
    """`torsh-dist train --nproc-per-node 2`, outside Slurm: the loss to match (once per session)."""
    return reference_summary()


@pytest.mark.timeout(240)  # 28 s with the cluster's start on a slow host (2026-11-30): margin for load
def test_srun_all_reduce_takes_ranks_and_master_from_slurm(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, str(script), str(out)],
        env=_env(cluster.env), capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + cluster.log_tail()
    rows = sorted((json.loads(f.read_text()) for f in out.glob("*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["local_rank"]) for r in rows] == [(0, 0), (1, 1)]
    job = rows[0]["job"]
    for row in rows:
        assert (row["world"], row["local_world"], row["source"]) == (2, 2, "slurm")
        assert row["sum"] == 3.0
        assert row["master"] == [cluster.node, SlurmEnvironment.job_port(job, 0)]


@pytest.mark.slow  # ~25 s: includes the reference run
@pytest.mark.timeout(240)
def test_srun_torsh_dist_train_matches_torsh_dist_run(
    cluster: SlurmCluster, reference: dict, tmp_path: Path
) -> None:
    proc = subprocess.run(
        ["srun", "-n", "2", "--kill-on-bad-exit=1", TORSH_DIST, "train", *TRAIN_FLAGS,
         "--summary-json", str(tmp_path / "summary.json"),
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        env=_env(cluster.env), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(tmp_path / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert summary["final_loss"] == pytest.approx(reference["final_loss"], abs=1e-5)
    assert summary["initial_loss"] == pytest.approx(reference["initial_loss"], abs=1e-5)


def _submit(
    cluster: SlurmCluster, tmp_path: Path, slurm_args: list[str], command: list[str]
) -> dict:
    """`torsh-dist slurm ... --submit`, wait for the job, check it succeeded; its summary."""
    script = tmp_path / "job.sbatch"
    log = tmp_path / "job-%j.out"
    proc = subprocess.run(
        [TORSH_DIST, "slurm", "--nodes", "1", "--procs-per-node", "2", "--time", "5",
         "--job-name", "torsh-test", "--job-output", str(log), "--output", str(script),
         "--submit", *slurm_args, "--", *command],
        env=_env(cluster.env), capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert match, proc.stdout
    job = match.group(1)
    state, code = cluster.wait_job(job, timeout=150)
    log_text = Path(str(log).replace("%j", job)).read_text(errors="replace")
    assert (state, code) == ("COMPLETED", "0:0"), f"{log_text[-4000:]}\n{cluster.log_tail()}"
    return _summary(tmp_path / "summary.json")


@pytest.mark.timeout(200)
def test_sbatch_script_from_torsh_dist_slurm_matches(
    cluster: SlurmCluster, reference: dict, tmp_path: Path
) -> None:
    summary = _submit(
        cluster, tmp_path, [],
        [TORSH_DIST, "train", *TRAIN_FLAGS, "--summary-json", str(tmp_path / "summary.json"),
         "--checkpoint-dir", str(tmp_path / "ckpt")],
    )
    assert summary["world_size"] == 2
    assert summary["final_loss"] == pytest.approx(reference["final_loss"], abs=1e-5)


@pytest.mark.slow  # ~18 s under load: one more sbatch job, plus torch's elastic agent
@pytest.mark.timeout(200)
def test_sbatch_agent_mode_matches(cluster: SlurmCluster, reference: dict, tmp_path: Path) -> None:
    summary = _submit(
        cluster, tmp_path, ["--mode", "agent", "--cpus-per-process", "1"],
        ["-m", "torsh_distributed.train", *TRAIN_FLAGS,
         "--summary-json", str(tmp_path / "summary.json"),
         "--checkpoint-dir", str(tmp_path / "ckpt")],
    )
    assert summary["world_size"] == 2
    assert summary["final_loss"] == pytest.approx(reference["final_loss"], abs=1e-5)
