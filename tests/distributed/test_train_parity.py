"""Data-parallel training of the built-in model equals single-process training (same global batch)."""

from __future__ import annotations

import json

import pytest

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train


def _config(**overrides) -> TrainConfig:
    cfg = preset("tiny")
    cfg.max_steps = 20
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 2
    cfg.data.max_bytes = 1_000_000
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _train(config_dict: dict) -> dict:
    result = train(TrainConfig.from_dict(config_dict))
    return {"losses": result.losses, "val": result.val_loss, "world": result.world_size}


@pytest.mark.slow
def test_two_ranks_match_one_process():
    cfg = _config().to_dict()
    single = run_distributed(_train, 1, args=(cfg,), timeout=120)[0]
    double = run_distributed(_train, 2, args=(cfg,), timeout=120)
    assert double[0] == double[1], "ranks disagree on the averaged losses"
    assert single["world"] == 1 and double[0]["world"] == 2
    assert len(single["losses"]) == len(double[0]["losses"]) == 20
    for step, (a, b) in enumerate(zip(single["losses"], double[0]["losses"], strict=True)):
        assert b == pytest.approx(a, rel=1e-5), f"step {step + 1}: {a} vs {b}"
    assert double[0]["val"] == pytest.approx(single["val"], rel=1e-5)
    assert single["losses"][-1] < single["losses"][0] - 0.5, "the loss did not fall"


def _train_indivisible(config_dict: dict) -> str:
    try:
        train(TrainConfig.from_dict(config_dict))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_indivisible_global_batch_is_rejected_on_every_rank():
    cfg = _config(batch_size=7).to_dict()
    messages = run_distributed(_train_indivisible, 2, args=(cfg,), timeout=60)
    for msg in messages:
        assert "batch_size 7 (global) is not divisible by the 2 data-parallel ranks" in msg


def _train_summary(config_dict: dict) -> None:
    train(TrainConfig.from_dict(config_dict))


def test_summary_json_written_by_rank_zero(tmp_path):
    out = tmp_path / "sub" / "summary.json"
    cfg = _config(max_steps=4, summary_json=str(out)).to_dict()
    run_distributed(_train_summary, 2, args=(cfg,), timeout=90)
    data = json.loads(out.read_text())
    for key in ("steps", "initial_loss", "final_loss", "val_loss", "tokens_per_s", "world_size"):
        assert key in data, key
    assert data["steps"] == 4 and data["world_size"] == 2 and data["tokens_per_s"] > 0
    assert not list(out.parent.glob("*.tmp"))
