"""`torsh-dist train` on 2 ranks with a constant carbon intensity writes the energy and carbon
contract into --summary-json (estimated on this VM: no RAPL, no GPU), and `torsh-dist energy
report` reads the run back."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from torsh_distributed.testing.cli import run_cli

QUICK = ["--preset", "tiny", "--data.max-bytes", "200000", "--max-steps", "4", "--batch-size", "8",
         "--eval-batches", "1", "--progress", "false"]


def _cli(args: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_cli(args, timeout=timeout)  # a warm process (torsh_distributed.testing.cli)


@pytest.mark.timeout(180)
def test_two_ranks_write_the_energy_and_carbon_contract(tmp_path: Path):
    summary = tmp_path / "run" / "summary.json"
    proc = _cli(["train", "--nproc-per-node", "2", *QUICK, "--carbon.intensity", "300",
                 "--energy.interval", "0.05", "--summary-json", str(summary)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(summary.read_text())
    energy, carbon = data["energy"], data["carbon"]
    # the contract for scripts
    for key in ("joules", "joules_per_step", "joules_per_token", "source", "meter"):
        assert key in energy, key
    assert energy["source"] == "estimated" and energy["meter"] == "estimate"
    assert "no hardware counter" in energy["why"]
    assert set(carbon) >= {"grams", "intensity_source"} and carbon["intensity_source"] == "constant"
    ranks = energy["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["joules"] > 0 for r in ranks)
    assert all(r["steps"] == 4 for r in ranks)
    # estimated per process: the job is the sum of its ranks
    assert energy["joules"] == pytest.approx(sum(r["joules"] for r in ranks))
    assert energy["joules_per_step"] == pytest.approx(energy["joules"] / 4)
    assert energy["joules_per_token"] == pytest.approx(energy["joules"] / (4 * 8 * 64))
    assert carbon["grams"] == pytest.approx(energy["joules"] / 3.6e6 * 300)
    assert "energy source" in proc.stdout and "carbon grams" in proc.stdout

    report = _cli(["energy", "report", str(tmp_path / "run"), "--plot", str(tmp_path / "e.png")])
    assert report.returncode == 0, report.stderr
    assert f"{energy['joules']:.4g} J (estimated, meter estimate) over 4 steps" in report.stdout
    assert (tmp_path / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
