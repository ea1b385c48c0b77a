"""The engine on user models that are not the GPT (other module names): every strategy equals one
process on the same global batch.

DDP, ZeRO-1/2/3 and DDP + fp16 compression at 2 ranks (1e-5 relative; fp16 within its bound),
a TP plan at tp=2, a 2-stage pipeline by split points, dp x pp on 4 ranks (1e-4), and a
checkpoint written on 4 ranks resumed on 2 with an identical continuation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torsh_distributed.testing import run_distributed

STEPS = 6


def _config(**parallel: Any) -> Any:
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.parallel.config import ParallelConfig

    return EngineConfig(
        max_steps=STEPS,
        batch_size=16,
        eval_batches=2,
        progress=False,
        optim=OptimConfig(lr=1e-2, warmup_steps=0),
        parallel=ParallelConfig(**parallel),
    )


def _engine(kind: str, config: Any) -> Any:
    from torsh_distributed.engine import Engine
    from torsh_distributed.testing import models as M

    if kind == "mlp":
        return Engine(M.mlp, dataset=M.classification_data(), val_dataset=M.classification_data(seed=1), config=config)
    if kind == "cnn":
        return Engine(M.cnn, dataset=M.image_data(), val_dataset=M.image_data(seed=1), config=config)
    assert kind == "lm"
    return Engine(
        M.tiny_lm,
        dataset=M.token_data(),
        val_dataset=M.token_data(seed=1),
        config=config,
        tp_plan=M.tiny_lm_plan() if config.parallel.tp > 1 else None,
    )


def _runs(cases: dict[str, tuple[str, dict, dict]]) -> dict[str, dict]:
    out = {}
    for name, (kind, parallel, extra) in cases.items():
        cfg = _config(**parallel)
        for key, value in extra.items():
            section, _, field = key.rpartition(".")
            setattr(getattr(cfg, section) if section else cfg, field, value)
        result = _engine(kind, cfg).fit()
        out[name] = {"losses": result.losses, "val": result.val_loss, "compression": result.compression}
    return out


DP_CASES = {
    "mlp ddp": ("mlp", {}, {}),
    "mlp zero1": ("mlp", {"zero_stage": 1}, {}),
    "lm zero2": ("lm", {"zero_stage": 2}, {}),
    "cnn zero3": ("cnn", {"zero_stage": 3}, {}),
    "lm zero3": ("lm", {"zero_stage": 3}, {}),
    "cnn ddp fp16": ("cnn", {}, {"compression.method": "fp16"}),
}
REFERENCE = {"mlp": ("mlp", {}, {}), "cnn": ("cnn", {}, {}), "lm": ("lm", {}, {})}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    return run_distributed(_runs, 1, args=(REFERENCE,), timeout=180)[0]


def _close(a: list[float], b: list[float], rel: float) -> None:
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert y == pytest.approx(x, rel=rel), f"step {step + 1}: {x} vs {y}"


@pytest.mark.slow
def test_data_parallel_strategies_equal_one_process(reference):
    results = run_distributed(_runs, 2, args=(DP_CASES,), timeout=300)
    for name in DP_CASES:  # compression figures are per rank (seconds); the losses are global
        assert results[0][name]["losses"] == results[1][name]["losses"], f"{name}: ranks disagree"
    for name, (kind, _, extra) in DP_CASES.items():
        got, want = results[0][name], reference[kind]
        rel = 2e-3 if "compression.method" in extra else 1e-5  # fp16: rounding of the exchange
        _close(want["losses"], got["losses"], rel)
        assert got["val"] == pytest.approx(want["val"], rel=rel), name
    assert results[0]["cnn ddp fp16"]["compression"]["ratio"] == pytest.approx(2.0, rel=0.01)
    assert reference["mlp"]["losses"][-1] < reference["mlp"]["losses"][0], "the MLP did not learn"


MP_CASES = {
    "lm tp2": ("lm", {"tp": 2}, {}),
    "lm pp2 split": ("lm", {"pp": 2, "pp_split": "layers.1"}, {}),
    "mlp pp2 split": ("mlp", {"pp": 2, "pp_split": "2", "microbatches": 4}, {}),
}


@pytest.mark.slow
def test_tensor_plan_and_pipeline_split_equal_one_process(reference):
    results = run_distributed(_runs, 2, args=(MP_CASES,), timeout=300)
    for name, (kind, _, _) in MP_CASES.items():
        _close(reference[kind]["losses"], results[0][name]["losses"], 1e-4)
        assert results[0][name]["val"] == pytest.approx(reference[kind]["val"], rel=1e-4)
        assert results[0][name]["losses"] == results[1][name]["losses"], f"{name}: ranks disagree"


def test_dp_by_pp_on_four_ranks_equals_one_process(reference):
    cases = {"lm dp2 x pp2": ("lm", {"pp": 2}, {})}
    results = run_distributed(_runs, 4, args=(cases,), timeout=300)
    _close(reference["lm"]["losses"], results[0]["lm dp2 x pp2"]["losses"], 1e-4)


def _resume_case(directory: str, resume: str) -> list[float]:
    cfg = _config()
    cfg.checkpoint.dir = directory
    cfg.checkpoint.every = 3
    cfg.checkpoint.keep_last = 0
    if resume:
        cfg.checkpoint.resume = resume
    return _engine("lm", cfg).fit().losses


def test_checkpoint_on_four_ranks_resumes_on_two(tmp_path: Path, reference):
    from torsh_distributed.checkpoint import step_dir_name

    straight = run_distributed(_resume_case, 4, args=(str(tmp_path / "a"), ""), timeout=180)[0]
    step3 = tmp_path / "a" / step_dir_name(3)
    assert step3.is_dir()
    resumed = run_distributed(
        _resume_case, 2, args=(str(tmp_path / "b"), str(step3)), timeout=180
    )[0]
    assert len(resumed) == STEPS
    assert resumed[:3] == straight[:3], "the resumed run reports the saved losses"
    # the continuation on 2 ranks draws the same global batches as the 4-rank run and 1 process
    _close(straight[3:], resumed[3:], 1e-5)
    _close(reference["lm"]["losses"], resumed, 1e-5)
