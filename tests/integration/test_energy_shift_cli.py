"""`torsh-dist train` on 2 ranks with carbon-aware time shifting, on a clean series that is
replaced, once training runs, by one with a dirty 2 s slot starting then (a refreshed forecast:
--carbon.refresh): the job checkpoints and pauses in that slot only, resumes at the next clean
slot, meets its deadline, and trains the losses of an unpaused run of the same config.

The dirty slot is written when the job says it trained its first step, so no slot has to be
placed against a start-up time guessed in advance: nothing here races the wall clock, and the test
runs beside the rest of the suite. Rank 0 is paced (``TORSH_FAULT=slow``, 20 ms a step) so that the
training cannot end before the job looks at the new series (every 0.5 s of steps).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import pytest

from torsh_distributed.testing.cli import run_cli, start_cli

SLOT_S = 2.0
STEPS = 300
REFRESH_S = 0.5
FIRST_STEP = "memory per rank after step 1"  # rank 0's line once the first step ran
QUICK = ["--nproc-per-node", "2", "--preset", "tiny", "--data.max-bytes", "200000",
         "--max-steps", str(STEPS), "--batch-size", "8", "--eval-batches", "1", "--progress", "false",
         "--energy.meter", "off"]


def _series(path: Path, *, now: float, dirty_at: float | None) -> None:
    """2 s slots from before ``now``, all 100 g/kWh but the one starting at ``dirty_at`` (412);
    written beside and renamed over ``path`` (a reader never sees half of it)."""
    before = 3 if dirty_at is None else math.ceil((dirty_at - now) / SLOT_S) + 3
    start = (now if dirty_at is None else dirty_at) - SLOT_S * before
    rows = [f"{start + SLOT_S * i:.3f},{412 if i == before and dirty_at is not None else 100}" for i in range(60)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("timestamp,gCO2/kWh\n" + "\n".join(rows) + "\n")
    os.replace(tmp, path)


def test_two_ranks_pause_only_in_the_dirty_slot_and_train_the_unpaused_losses(tmp_path: Path):
    # warm processes (torsh_distributed.testing.cli)
    ref_proc = run_cli(["train", *QUICK, "--summary-json", str(tmp_path / "ref.json")], timeout=240)
    assert ref_proc.returncode == 0, ref_proc.stdout[-3000:] + ref_proc.stderr[-3000:]
    ref = json.loads((tmp_path / "ref.json").read_text())

    path = tmp_path / "s.csv"
    _series(path, now=time.time(), dirty_at=None)
    out_json = tmp_path / "paused.json"
    log = tmp_path / "paused.log"
    proc = start_cli(
        ["train", *QUICK, "--carbon.series", str(path), "--carbon.max-intensity",
         "300", "--carbon.deadline", "10m", "--carbon.refresh", str(REFRESH_S), "--checkpoint.dir",
         str(tmp_path / "ckpt"), "--summary-json", str(out_json)],
        output=log, env={**os.environ, "TORSH_FAULT": "slow:rank=0:ms=20"},
    )  # fmt: skip
    lines, dirty_at = [], math.nan
    for line in proc.lines(log):
        lines.append(line)
        if math.isnan(dirty_at) and FIRST_STEP in line:
            dirty_at = round(time.time(), 3)
            _series(path, now=dirty_at, dirty_at=dirty_at)
    proc.wait(timeout=240)
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    data = json.loads(out_json.read_text())
    carbon = data["carbon"]

    # paused once, in the dirty slot, found at the first check after the change, until the next
    # (clean) slot
    assert len(carbon["pauses"]) == 1, (carbon, out[-3000:])
    pause = carbon["pauses"][0]
    assert dirty_at <= pause["start"] < dirty_at + SLOT_S and pause["intensity"] == 412
    assert dirty_at + SLOT_S <= pause["start"] + pause["seconds"] < dirty_at + 2 * SLOT_S
    assert carbon["paused_s"] == pytest.approx(pause["seconds"]) and carbon["ran_through"] == []
    assert f"carbon: {path} changed: following the new series" in out
    found = re.findall(r"carbon: intensity .*", out)
    assert len(found) == 1 and found[0].startswith(
        f"carbon: intensity 412 g/kWh > 300 at step {pause['step']}: paused "), found
    assert found[0].rstrip().endswith("(next slot 100 g/kWh)")
    assert "carbon: time shifting: pausing while the intensity is above 300 g/kWh" in out
    assert re.search(r"carbon paused s +\| +[0-9.]+ \|", out) and "carbon met deadline" in out
    # checked a few times, not at every step; the checkpoint before the pause, then the final one
    assert 0 < carbon["shift_checks"] < STEPS / 4
    assert data["checkpoint"]["saves"] == 2
    assert (tmp_path / "ckpt" / f"step_{pause['step']:08d}").is_dir()
    # met its deadline, and trained exactly what the unpaused run trained
    assert carbon["met_deadline"] is True and carbon["deadline_unix_s"] > carbon["ended_unix_s"]
    assert data["steps"] == ref["steps"] == STEPS
    for key in ("initial_loss", "final_loss", "val_loss"):
        assert data[key] == pytest.approx(ref[key], abs=1e-5), key
    assert "carbon" not in ref or "pauses" not in ref["carbon"]
