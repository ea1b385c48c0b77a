"""`torsh-dist train --nproc-per-node 1:2 --carbon.scale` on a series that is dirty when the job
starts and is replaced, once training runs, by one that is clean from then on (a refreshed
forecast: --carbon.refresh): the job starts at 1 worker, checkpoints at its first check after the
change and restarts at 2 workers from that checkpoint (the world size follows the series), and ends
at the loss of an uninterrupted run of the same config within the elastic tests' tolerance.

The change is made when the job says it trained its first step, so no slot has to be placed
against a start-up time guessed in advance: nothing here races the wall clock, and the test runs
beside the rest of the suite. Rank 0 of the scaled run is paced (``TORSH_FAULT=slow``, 10 ms a
step) so that the first segment cannot end before the job looks at the new series (every 0.5 s of
steps). The uninterrupted run is the same command on a series that stays dirty (one segment at 1
worker, never scaled).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from torsh_distributed.testing.cli import run_cli, start_cli

STEPS = 300
QUICK = ["--preset", "tiny", "--data.max-bytes", "200000", "--max-steps", str(STEPS), "--batch-size", "8",
         "--eval-batches", "1", "--progress", "false", "--threads", "1"]
CLEAN, DIRTY = 100, 400
REFRESH_S = 0.5  # --carbon.refresh: the job looks at the series file at least this often
PACE_MS = 10  # rank 0 of the scaled run is paced (TORSH_FAULT=slow): it cannot end before it looks
FIRST_STEP = "memory per rank after step 1"  # rank 0's line once the first step ran
CLI = ["train"]  # run_cli's and start_cli's arguments: torsh-dist train in a warm process


def _train(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    launched = time.time()
    proc = run_cli([*CLI, *args], timeout=200)  # a warm process (torsh_distributed.testing.cli)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, launched


def _write_series(path: Path, start: float, values: list[int]) -> None:
    """1 s slots from ``start``; written beside and renamed over ``path`` (a reader never sees
    half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("timestamp,gCO2/kWh\n" + "".join(f"{start + i:.3f},{v}\n" for i, v in enumerate(values)))
    os.replace(tmp, path)


def _train_changing(args: list[str], change: Callable[[], float], log: Path) -> tuple[str, float]:
    """Runs the command (its output in ``log``); calls ``change`` (which returns when it changed
    the series) when the job reports its first step. The output and that time."""
    proc = start_cli([*CLI, *args], output=log, env={**os.environ, "TORSH_FAULT": f"slow:rank=0:ms={PACE_MS}"})
    lines, changed_at = [], math.nan
    for line in proc.lines(log):
        lines.append(line)
        if math.isnan(changed_at) and FIRST_STEP in line:
            changed_at = change()
    proc.wait(timeout=200)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert not math.isnan(changed_at), out[-3000:]
    return out, changed_at


@pytest.mark.timeout(300)
def test_the_world_size_follows_the_series_and_the_loss_is_the_uninterrupted_runs(tmp_path: Path):
    dirty = [DIRTY] * 900 + [CLEAN]  # dirty for 15 minutes (one clean slot at its end sets the scale)
    reference = tmp_path / "dirty.csv"
    _write_series(reference, round(time.time(), 3) - 1.0, dirty)
    _train([*QUICK, "--nproc-per-node", "1:2", "--carbon.scale", "--carbon.series", str(reference),
            "--checkpoint.dir", str(tmp_path / "ref-ckpt"), "--summary-json", str(tmp_path / "ref.json")])
    ref = json.loads((tmp_path / "ref.json").read_text())
    ref_scaling = ref["carbon"]["scaling"]
    assert ref_scaling["world_sizes"] == [1] and len(ref_scaling["segments"]) == 1  # uninterrupted

    series = tmp_path / "s.csv"
    _write_series(series, round(time.time(), 3) - 1.0, dirty)

    def clean_from_now() -> float:
        now = round(time.time(), 3)
        _write_series(series, now - 1.0, [DIRTY] + [CLEAN] * 900)  # clean from `now` on
        return now

    out, clean_at = _train_changing(
        [*QUICK, "--nproc-per-node", "1:2", "--carbon.scale", "--carbon.series", str(series),
         "--carbon.refresh", str(REFRESH_S), "--checkpoint.dir", str(tmp_path / "ckpt"),
         "--summary-json", str(tmp_path / "scaled.json")],
        clean_from_now,
        tmp_path / "scaled.log",  # kept with the run, for a reader
    )  # fmt: skip
    data = json.loads((tmp_path / "scaled.json").read_text())
    scaling = data["carbon"]["scaling"]
    segments = scaling["segments"]

    # the world size followed the series: 1 worker while dirty, 2 once it was clean
    assert scaling["world_sizes"] == [1, 2], (scaling["decisions"], out[-3000:])
    assert [(d["intensity"], d["world_size"]) for d in scaling["decisions"]] == [(DIRTY, 1), (CLEAN, 2)]
    assert scaling["decisions"][1]["unix_s"] >= clean_at
    stop = segments[0]["stop"]
    assert (stop["intensity"], stop["world_size"]) == (CLEAN, 2) and segments[1]["stop"] is None
    # found at the first check after the change: checks come at most REFRESH_S of steps apart
    step_s = (segments[0]["ended_unix_s"] - segments[0]["first_step_unix_s"]) / stop["step"]
    assert clean_at <= stop["unix_s"] <= clean_at + REFRESH_S + 3 * step_s + 0.5, (stop, clean_at, step_s)
    # rank 0 saw the change first, then the launcher as it chose the second segment's size
    assert f"[rank0]: carbon: {series} changed: following the new series" in out, out[-3000:]
    assert f"torsh-dist: carbon: {series} changed: following the new series" in out, out[-3000:]
    # contiguous segments, the second resumed from the checkpoint the first saved when it stopped
    assert [(s["start_step"], s["end_step"]) for s in segments] == [(0, stop["step"]), (stop["step"], STEPS)]
    assert 0 < stop["step"] < STEPS and (tmp_path / "ckpt" / f"step_{stop['step']:08d}").is_dir()
    assert f"resumed from {tmp_path / 'ckpt'}/step_{stop['step']:08d} at step {stop['step']}" in out
    assert out.count("torsh-dist: segment ") == 2
    assert f"carbon: intensity {CLEAN} g/kWh at step {stop['step']}: world size 1 -> 2" in out
    # the job's energy and carbon are every segment's, summed
    assert scaling["joules"] == pytest.approx(sum(s["joules"] for s in segments))
    assert scaling["grams"] == pytest.approx(sum(s["grams"] for s in segments)) and scaling["grams"] > 0
    assert data["carbon"]["grams"] == pytest.approx(segments[-1]["grams"])
    assert re.search(r"carbon scaling world sizes +\| +1 -> 2 +\|", out), out[-3000:]
    # the same training as the uninterrupted run (the elastic tests' tolerance)
    assert data["steps"] == ref["steps"] == STEPS and data["world_size"] == 2
    assert data["initial_loss"] == pytest.approx(ref["initial_loss"], abs=1e-6)
    for key in ("final_loss", "val_loss"):
        assert data[key] == pytest.approx(ref[key], abs=2e-3), key
