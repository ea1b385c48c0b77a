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


def _train_variants(variants: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for name, config_dict in variants.items():
        result = train(TrainConfig.from_dict(config_dict))
        out[name] = {"losses": result.losses, "compression": result.compression}
    return out


def test_gradient_accumulation_matches_the_whole_batch():
    """--grad-accum 2 (DDP no_sync, FSDP2 without gradient sync) == one pass over the batch."""
    variants = {}
    for stage in (0, 3):
        for accum in (1, 2):
            cfg = _config(max_steps=6, grad_accum=accum)
            cfg.parallel.zero_stage = stage
            variants[f"zero{stage}-accum{accum}"] = cfg.to_dict()
    results = run_distributed(_train_variants, 2, args=(variants,), timeout=240)[0]
    for stage in (0, 3):
        whole, parts = results[f"zero{stage}-accum1"], results[f"zero{stage}-accum2"]
        for step, (a, b) in enumerate(zip(whole["losses"], parts["losses"], strict=True)):
            assert b == pytest.approx(a, rel=1e-5), f"zero {stage}, step {step + 1}: {a} vs {b}"
    # one gradient exchange per step, not per micro-batch
    assert results["zero0-accum2"]["compression"]["steps"] == 6


def test_gradient_accumulation_must_divide_the_per_rank_batch():
    with pytest.raises(ValueError, match="grad_accum 3 must divide the per-rank batch 4"):
        _config(grad_accum=3).check_world(2)
    with pytest.raises(ValueError, match=r"train.grad_accum must be > 0, got 0"):
        TrainConfig(grad_accum=0)
    cfg = _config(grad_accum=2)
    cfg.parallel.tp = 2
    for msg in run_distributed(_train_indivisible, 2, args=(cfg.to_dict(),), timeout=60):
        assert "--grad-accum 2 applies to data parallelism" in msg, msg


def _accumulated_grads() -> dict[str, float]:
    import torch

    from torsh_distributed.models.gpt import GPT, lm_loss
    from torsh_distributed.parallel.config import ParallelConfig
    from torsh_distributed.parallel.data import accumulate, apply_ddp
    from torsh_distributed.parallel.precision import LossScaler
    from torsh_distributed.train.config import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(block_size=16, n_layer=1, n_head=2, d_model=32)
    scaler = LossScaler.from_config(ParallelConfig(), device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    tokens = torch.randint(0, 256, (4, 17), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = {}
    grads = {}
    for parts in (1, 2, 4):
        torch.manual_seed(0)
        base = GPT(cfg)
        model = apply_ddp(base)
        if parts == 1:
            model(x, y)[1].backward()
        else:
            accumulate(model, lm_loss, scaler, x, y, parts)
        grads[parts] = torch.cat([p.grad.reshape(-1) for p in base.parameters()])
    for parts in (2, 4):
        out[f"diff{parts}"] = float((grads[parts] - grads[1]).abs().max() / grads[1].abs().max())
    return out


def test_accumulated_gradients_equal_the_whole_batch_gradient():
    """Exact gradients (AdamW would hide a wrong scale in the losses): sum of parts / parts."""
    for r in run_distributed(_accumulated_grads, 2, timeout=90):
        assert r["diff2"] < 1e-6 and r["diff4"] < 1e-6, r
