"""`make gpu-check` without CUDA: the dry pass of every step (arguments, outputs, commands), the
wheel list, and a clear refusal of an unknown step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry pass runs without CUDA")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)


def test_dry_pass_checks_every_step_and_writes_the_report(tmp_path: Path):
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith("gpu-check: no CUDA device here: dry pass")
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["dry_run"] is True
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["tests", "bench-train", "bench-generate", "bench-codecs"]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    # the dry pass collected tests/gpu and ran each benchmark's --help
    log = (tmp_path / "gpu-check.log").read_text()
    assert "test_engine_cuda.py" in log and "usage: bench_gpu_train.py" in log
    assert "usage: bench_gpu_codecs.py" in log and "usage: bench_vs_transformers.py" in log
    assert steps["tests"]["outputs"] == [str(tmp_path / "gpu-tests.xml")]
    # the power-limit test changes the GPU's settings: never run on a lent machine
    assert "tests/gpu/test_energy_power_gpu.py" in report["deselected"]


def test_unknown_step_is_refused_by_name(tmp_path: Path):
    proc = _run("--out", str(tmp_path), "--only", "tests,benchh")
    assert proc.returncode == 2
    assert "unknown step(s) benchh" in proc.stderr
    assert not (tmp_path / "gpu-check.json").exists()


def test_wheel_list_pins_one_version_each():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    pins = gpu_check.wheel_list()
    assert "tenacity" in pins and "fastapi" in pins and "openai" in pins
    assert all(v and v[0].isdigit() for v in pins.values()), pins
    lines = [ln.split("#")[0].strip() for ln in gpu_check.WHEEL_LIST.read_text().splitlines()]
    names = [ln.split("==")[0].lower().replace("-", "_") for ln in lines if ln]
    assert len(names) == len(set(names))  # two versions of one package stop the whole install
