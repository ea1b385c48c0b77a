"""`torsh-dist train` end to end: real launcher, real ranks, summary JSON."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from torsh_distributed.testing.cli import run_cli

SMALL = ["--preset", "tiny", "--data.max-bytes", "400000", "--eval-batches", "2"]


def _run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_cli(args, timeout=timeout)  # a warm process (torsh_distributed.testing.cli)


@pytest.mark.slow
def test_train_two_ranks_loss_falls_and_summary_written(tmp_path: Path):
    out = tmp_path / "summary.json"
    proc = _run(["train", "--nproc-per-node", "2", *SMALL, "--max-steps", "60",
                 "--summary-json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 60
    assert summary["final_loss"] < summary["initial_loss"] - 1.5
    assert summary["tokens_per_s"] > 0 and summary["val_loss"] < summary["initial_loss"]
    assert "[rank0]: " in proc.stdout
    assert re.search(r"\| final train loss \(last 10\) +\| +[0-9.]+ \|", proc.stdout)
    assert proc.stdout.count("| steps ") == 1, "only rank 0 prints the summary"


def test_train_through_run_module_form(tmp_path: Path):
    out = tmp_path / "s.json"
    proc = _run(["run", "--nproc-per-node", "2", "-m", "torsh_distributed.train", *SMALL,
                 "--max-steps", "3", "--progress", "false", "--summary-json", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(out.read_text())["world_size"] == 2


def test_indivisible_batch_fails_before_launch():
    proc = _run(["train", "--nproc-per-node", "4", "--batch-size", "30"], timeout=60)
    assert proc.returncode == 2
    assert "batch_size 30 (global) is not divisible by the 4 data-parallel ranks" in proc.stderr
    assert "Traceback" not in proc.stderr and "[rank" not in proc.stdout


def test_bad_flag_value_is_one_clear_line():
    proc = _run(["train", "--model.d-model", "30", "--model.n-head", "4"], timeout=60)
    assert proc.returncode == 2
    assert "model.d_model (30) must be divisible by model.n_head (4)" in proc.stderr
    assert "Traceback" not in proc.stderr
