"""`make demo`, the `demo` preset and the README's record of a demo run stay consistent.

The Makefile's demo target trains the `demo` preset as it is (no flag changes its model, batch
or steps) and samples from the checkpoint it wrote; the README's demo summary shows the preset's
step count and measured losses (no placeholders), and names the preset's shape.
"""

from __future__ import annotations

import re
from pathlib import Path

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
