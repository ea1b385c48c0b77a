"""``optim.lr_ref_batch``: the engine scales the tuned lr and warm-up to the run's global batch
(one process, the engine's own loop). Proof by parity: a run with a reference batch trains
exactly as the same run given the scaled lr and warm-up by hand, and differs from the unscaled
run; the rule, factor and reason reach the start-up line and the summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest


def _fit(tmp_path: Path, *, batch: int = 16, factory: Any = None, **optim: Any) -> Any:
    from torsh_distributed.engine import Engine
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.testing import models as M

    config = EngineConfig(
        max_steps=6, batch_size=batch, eval_batches=1, progress=False, seed=7,
        optim=OptimConfig(**optim), summary_json=str(tmp_path / "summary.json"),
    )
    extra = {"optimizer": factory} if factory is not None else {}
    return Engine(M.mlp, dataset=M.classification_data(), config=config, **extra).fit()


def test_sgd_at_4x_the_reference_batch_trains_as_the_hand_scaled_lr(tmp_path: Path, capsys):
    # SGD, 16 = 4x the reference 4: linear (Goyal et al.), lr x4, warm-up 8 -> 2 steps (its samples)
    scaled = _fit(tmp_path, optimizer="sgd", lr=0.0625, warmup_steps=8, lr_ref_batch=4)
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    by_hand = _fit(tmp_path, optimizer="sgd", lr=0.25, warmup_steps=2)
    unscaled = _fit(tmp_path, optimizer="sgd", lr=0.0625, warmup_steps=8)
    assert scaled.losses == by_hand.losses
    assert scaled.losses != unscaled.losses
    rule = scaled.lr_scaling
    assert (rule["rule"], rule["ratio"], rule["factor"]) == ("linear", 4.0, 4.0)
    assert (rule["lr"], rule["warmup_steps"]) == (0.25, 2) and "Goyal" in rule["reason"]
    assert summary["lr_scaling"] == rule and unscaled.lr_scaling == {}
    assert "lr scaling: linear x4 (global batch 16 = 4x the reference): lr 0.25, warm-up 2" in out


def test_adamw_takes_the_square_root_and_a_smaller_batch_lowers_the_lr(tmp_path: Path):
    # AdamW at 1/4 of the reference batch 64: square root (Malladi et al.), lr / 2, warm-up x4
    scaled = _fit(tmp_path, lr=4e-3, warmup_steps=2, lr_ref_batch=64)
    by_hand = _fit(tmp_path, lr=2e-3, warmup_steps=8)
    assert scaled.losses == by_hand.losses
    assert scaled.lr_scaling["rule"] == "sqrt" and scaled.lr_scaling["factor"] == 0.5
    forced = _fit(tmp_path, lr=4e-3, warmup_steps=2, lr_ref_batch=64, lr_scaling="linear")
    assert forced.lr_scaling["factor"] == 0.25 and forced.lr_scaling["lr"] == pytest.approx(1e-3)
    same = _fit(tmp_path, lr=4e-3, warmup_steps=2, lr_ref_batch=16)  # the tuned batch: unchanged
    plain = _fit(tmp_path, lr=4e-3, warmup_steps=2)
    assert same.losses == plain.losses and same.lr_scaling["rule"] == "none"
    assert math.isclose(same.lr_scaling["factor"], 1.0)


def test_an_optimizer_factory_with_a_reference_batch_is_refused(tmp_path: Path):
    import torch

    with pytest.raises(ValueError, match="optim.lr_ref_batch scales config.optim's lr"):
        _fit(tmp_path, factory=lambda p: torch.optim.SGD(p, lr=0.1), lr_ref_batch=4)


def test_a_warm_up_scaled_past_the_run_is_warned(tmp_path: Path):
    # 8 warm-up steps at 64 -> 32 at 16 (its samples), longer than the 6-step run
    with pytest.warns(UserWarning, match="32 warm-up steps at global batch 16, not fewer than "
                      "max_steps 6"):
        _fit(tmp_path, lr=4e-3, warmup_steps=8, lr_ref_batch=64)


def test_a_diverged_run_names_the_lr_given_and_the_lr_it_was_scaled_to(tmp_path: Path):
    # --lr 1e6 tuned at batch 4, run at 16: the message used to call the scaled 4e6 "--lr"
    with pytest.raises(FloatingPointError) as caught:
        _fit(tmp_path, optimizer="sgd", lr=1e6, lr_ref_batch=4)
    message = str(caught.value)
    assert "lower the learning rate (--lr 1e+06, scaled linear x4 to 4e+06 for the global batch " \
           "16: lower --lr, or --lr-scaling)" in message, message
    with pytest.raises(FloatingPointError, match=r"lower the learning rate \(--lr, now 1000000.0\)"):
        _fit(tmp_path, optimizer="sgd", lr=1e6)
