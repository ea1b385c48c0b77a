"""`make demo`, the `demo` preset and the README's record of a demo run stay consistent.

The Makefile's demo target installs torch and the package without extras (`make test` installs
every extra), trains the `demo` preset as it is (no flag changes its model, batch or steps) and
samples from the checkpoint it wrote; the README's demo summary shows the preset's
step count and measured losses (no placeholders), and names the preset's shape.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from torsh_distributed.train.config import preset

ROOT = Path(__file__).resolve().parents[2]


def _demo_recipe() -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("demo:")))
    recipe: list[str] = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return " ".join(recipe).replace("\\ ", "").split("$(VENV)/bin/torsh-dist ")[1:]


def test_make_demo_trains_the_demo_preset_and_samples_its_checkpoint():
    train, generate = _demo_recipe()
    assert train.startswith("train ") and "--preset demo" in train
    for flag in ("--model.", "--batch-size", "--max-steps", "--optim.", "--lr"):
        assert flag not in train, f"make demo overrides the demo preset with {flag}"
    out = re.search(r"--checkpoint-dir (\S+)", train)
    assert out is not None and f"--checkpoint {out.group(1)} " in generate
    assert generate.startswith("generate ")


def test_readme_records_a_run_of_the_demo_preset():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("make demo") :]
    block = block[: block.index("## Using the library")]
    config = preset("demo")
    assert re.search(rf"\| steps +\| +{config.max_steps} \|", block), "steps of the demo preset"
    for row in ("final train loss (last 10)", "validation loss"):
        match = re.search(rf"\| {re.escape(row)} +\| +(\S+) \|", block)
        assert match is not None and re.fullmatch(r"\d\.\d+", match.group(1)), row
    model = config.model
    shape = f"{model.n_layer} layers, width {model.d_model}, context {model.block_size}"
    assert shape in block, f"the README should say the preset's shape: {shape}"


def _pip_installs(target: str, tmp_path: Path) -> list[str]:
    """The install lines ``make TARGET`` would run into a fresh virtual environment (``pip
    install`` itself, or ``scripts/pip_install.py``, which takes the same arguments)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    done = subprocess.run(
        [make, "-n", f"VENV={tmp_path / 'venv'}", target],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )
    return [line for line in done.stdout.splitlines() if "pip install" in line or "pip_install.py" in line]


def test_make_demo_installs_only_torch_and_the_package(tmp_path: Path):
    installs = _pip_installs("demo", tmp_path)
    assert any('"torch==' in line for line in installs), installs
    assert any(line.endswith("scripts/pip_install.py -e .") for line in installs), installs
    assert not any("[" in line for line in installs), f"make demo installs extras: {installs}"


def test_make_test_installs_every_extra_the_suite_uses(tmp_path: Path):
    text = "\n".join(_pip_installs("install", tmp_path))
    match = re.search(r'-e "\.\[([^\]]+)\]"', text)
    assert match is not None, text
    assert {"dev", "redis", "monitor", "plot", "ray", "dask", "energy", "federated", "serve"} <= set(
        match.group(1).split(",")
    )
