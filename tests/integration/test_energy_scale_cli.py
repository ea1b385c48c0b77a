"""`torsh-dist train --nproc-per-node 1:2 --carbon.scale` on a series of 1 s slots, dirty when
the job starts and clean a few seconds into its training: the job starts at 1 worker,
checkpoints at the first step of the clean slots and restarts at 2 workers from that checkpoint
(the world size follows the series), and ends at the loss of an uninterrupted run of the same
config within the elastic tests' tolerance.

The series' times are absolute, so the clean slots are placed from a reference run just before,
on the same machine and the same path: the same command on a series dirty for 15 minutes (one
segment at 1 worker, never scaled: the uninterrupted run). The first clean slot starts half of its training
time after the moment its first decision was made (relative to launch): a scaled run may start
that much slower, or faster, than the reference and still meet a dirty slot first and a clean one
before its last step. A start-up slower than its dirty slots only moves the change earlier (to
the first step).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 900
QUICK = ["--preset", "tiny", "--data.max-bytes", "200000", "--max-steps", str(STEPS), "--batch-size", "8",
         "--eval-batches", "1", "--progress", "false", "--threads", "1"]
CLEAN, DIRTY = 100, 400


def _train(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    code = "import sys\nfrom torsh_distributed.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    launched = time.time()
    proc = subprocess.run([sys.executable, "-c", code, "train", *QUICK, *args], capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, launched


def _write_series(path: Path, start: float, values: list[int]) -> None:
    path.write_text("timestamp,gCO2/kWh\n" + "".join(f"{start + i:.3f},{v}\n" for i, v in enumerate(values)))


@pytest.mark.serial  # its series has 1-2 s slots: it runs alone (make test)
@pytest.mark.timeout(300)
def test_the_world_size_follows_the_series_and_the_loss_is_the_uninterrupted_runs(tmp_path: Path):
    reference = tmp_path / "dirty.csv"
    # dirty for 15 minutes (the series' sizes are relative: one clean slot at its end sets the scale)
    _write_series(reference, round(time.time(), 3) - 1.0, [DIRTY] * 900 + [CLEAN])
    _, launched = _train(["--nproc-per-node", "1:2", "--carbon.scale", "--carbon.series", str(reference),
                          "--checkpoint.dir", str(tmp_path / "ref-ckpt"), "--summary-json", str(tmp_path / "ref.json")])
    ref = json.loads((tmp_path / "ref.json").read_text())
    ref_scaling = ref["carbon"]["scaling"]
    assert ref_scaling["world_sizes"] == [1] and len(ref_scaling["segments"]) == 1  # uninterrupted
    first_decision = ref_scaling["decisions"][0]["unix_s"] - launched
    training = ref_scaling["segments"][0]["ended_unix_s"] - ref_scaling["segments"][0]["first_step_unix_s"]
    start = round(time.time(), 3) - 1.0  # the scaled run launches about 1 s into slot 0
    clean_from = math.ceil(1.0 + first_decision + training / 2)
    values = [DIRTY if i < clean_from else CLEAN for i in range(clean_from + 60)]
    _write_series(tmp_path / "s.csv", start, values)
    proc, _ = _train(["--nproc-per-node", "1:2", "--carbon.scale", "--carbon.series", str(tmp_path / "s.csv"),
                      "--checkpoint.dir", str(tmp_path / "ckpt"), "--summary-json", str(tmp_path / "scaled.json")])
    (tmp_path / "scaled.log").write_text(proc.stdout)  # kept with the run, for a reader
    data = json.loads((tmp_path / "scaled.json").read_text())
    scaling = data["carbon"]["scaling"]
    segments = scaling["segments"]

    # the world size followed the series: 1 worker while dirty, 2 from the first clean slot on
    assert scaling["world_sizes"] == [1, 2], (scaling["decisions"], proc.stdout[-3000:])
    for decision in scaling["decisions"]:
        at = int(decision["unix_s"] - start)
        assert decision["intensity"] == values[at]
        assert decision["world_size"] == (1 if values[at] == DIRTY else 2)
    stop = segments[0]["stop"]
    assert (stop["intensity"], stop["world_size"]) == (CLEAN, 2) and segments[1]["stop"] is None
    assert stop["unix_s"] >= start + clean_from
    if segments[0]["first_step_unix_s"] < start + clean_from:  # found within the first clean slot
        assert stop["unix_s"] <= start + clean_from + 1.0
    else:  # a start-up slower than the clean slot's start: the first check (after step 1) changes
        assert stop["step"] == 1
    # contiguous segments, the second resumed from the checkpoint the first saved when it stopped
    assert [(s["start_step"], s["end_step"]) for s in segments] == [(0, stop["step"]), (stop["step"], STEPS)]
    assert 0 < stop["step"] < STEPS and (tmp_path / "ckpt" / f"step_{stop['step']:08d}").is_dir()
    assert f"resumed from {tmp_path / 'ckpt'}/step_{stop['step']:08d} at step {stop['step']}" in proc.stdout
    assert proc.stdout.count("torsh-dist: segment ") == 2
    assert f"carbon: intensity {CLEAN} g/kWh at step {stop['step']}: world size 1 -> 2" in proc.stdout
    # the job's energy and carbon are every segment's, summed
    assert scaling["joules"] == pytest.approx(sum(s["joules"] for s in segments))
    assert scaling["grams"] == pytest.approx(sum(s["grams"] for s in segments)) and scaling["grams"] > 0
    assert data["carbon"]["grams"] == pytest.approx(segments[-1]["grams"])
    assert re.search(r"carbon scaling world sizes +\| +1 -> 2 +\|", proc.stdout), proc.stdout[-3000:]
    # the same training as the uninterrupted run (the elastic tests' tolerance)
    assert data["steps"] == ref["steps"] == STEPS and data["world_size"] == 2
    assert data["initial_loss"] == pytest.approx(ref["initial_loss"], abs=1e-6)
    for key in ("final_loss", "val_loss"):
        assert data[key] == pytest.approx(ref[key], abs=2e-3), key
