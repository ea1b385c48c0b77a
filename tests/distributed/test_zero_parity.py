"""ZeRO-1/2/3 (and offload, activation checkpointing) train exactly like DDP; memory = formula.

Each rank runs every variant in one process group (one spawn per world size keeps this fast):
the same global batch and seed, so the per-step global losses must agree with DDP's within
1e-5 relative (fp32). The memory each rank measured after step 1 must equal the planner's
formula exactly (the tiny model's first dimensions divide by 2 and 4, so no padding), except
ZeRO-1, whose whole-parameter partition is uneven by design: there the per-rank optimizer state
sums to the formula's total.
"""

from __future__ import annotations

import json
import math

import pytest

from torsh_distributed.plan import model_state_bytes
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

VARIANTS: dict[str, dict] = {
    "ddp": {},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "zero3_offload": {"zero_stage": 3, "offload": "cpu"},
    "zero2_ac_full": {"zero_stage": 2, "activation_checkpointing": "full"},
    "ddp_ac_every2": {"activation_checkpointing": "every-2"},
    "zero3_size_wrap": {"zero_stage": 3, "wrap": "size", "wrap_min_params": 20_000},
}
# not bitwise comparable with DDP: bf16 rounds; meta init draws different initial weights
EXTRA: dict[str, dict] = {
    "zero3_bf16": {"zero_stage": 3, "param_dtype": "bf16"},
    "zero3_meta": {"zero_stage": 3, "meta_init": True},
}


def _config(steps: int = 6, **model) -> dict:
    cfg = preset("tiny")
    cfg.max_steps = steps
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 300_000
    cfg.model.n_layer = 4
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg.to_dict()


def _run_variants(config: dict, variants: dict[str, dict]) -> dict:
    out = {}
    for name, parallel in variants.items():
        data = json.loads(json.dumps(config))
        data["parallel"] = parallel
        result = train(TrainConfig.from_dict(data))
        out[name] = {
            "losses": result.losses,
            "val": result.val_loss,
            "memory": result.memory,
            "num_params": result.num_params,
        }
    return out


def _check_parity(results: list[dict], world: int) -> None:
    ddp = results[0]["ddp"]["losses"]
    assert ddp[-1] < ddp[0], "the loss did not fall"
    for name in VARIANTS:
        assert results[0][name]["losses"] == results[-1][name]["losses"], f"{name}: ranks disagree"
        for step, (a, b) in enumerate(zip(ddp, results[0][name]["losses"], strict=True)):
            assert b == pytest.approx(a, rel=1e-5), f"{name} at {world} ranks, step {step + 1}"
        assert results[0][name]["val"] == pytest.approx(results[0]["ddp"]["val"], rel=1e-5)


def _check_memory(results: list[dict], world: int, variants: dict[str, dict]) -> None:
    for rank_results in results:
        for name, parallel in variants.items():
            memory = rank_results[name]["memory"]
            stage = parallel.get("zero_stage", 0)
            measured = memory["model_state_bytes_per_rank"]
            predicted = memory["predicted_model_state_bytes_per_rank"]
            num_params = rank_results[name]["num_params"]
            formula = model_state_bytes(num_params, world, stage, dtype="fp32", layout="fsdp2")
            assert predicted == formula.to_dict(), name
            assert measured["padding"] == {"params": 0, "grads": 0, "optimizer": 0}, name
            assert measured["params"] == formula.params, name
            assert measured["grads"] == formula.grads, name
            if stage != 1:
                assert measured["optimizer"] == formula.optimizer, name
                assert measured["total"] == formula.total, name
    # ZeRO-1: torch partitions whole parameters; the shards add up to the full state
    total = sum(r["zero1"]["memory"]["model_state_bytes_per_rank"]["optimizer"] for r in results)
    stage0 = results[0]["ddp"]["memory"]["model_state_bytes_per_rank"]["optimizer"]
    assert total == stage0
    # the sharded stages hold a 1/world share, as measured (not only as predicted)
    ddp_total = results[0]["ddp"]["memory"]["model_state_bytes_per_rank"]["total"]
    zero3_total = results[0]["zero3"]["memory"]["model_state_bytes_per_rank"]["total"]
    assert zero3_total * world == ddp_total


@pytest.mark.slow
def test_zero_stages_match_ddp_on_two_ranks():
    variants = {**VARIANTS, **EXTRA}
    results = run_distributed(_run_variants, 2, args=(_config(), variants), timeout=300)
    _check_parity(results, 2)
    _check_memory(results, 2, variants)
    ddp = results[0]["ddp"]["losses"]
    for name in EXTRA:
        losses = results[0][name]["losses"]
        assert losses == results[1][name]["losses"], f"{name}: ranks disagree"
        assert losses[-1] < losses[0], f"{name}: the loss did not fall"
    # bf16 forward/backward with fp32 master shards and fp32 reduction stays close to fp32
    for a, b in zip(ddp, results[0]["zero3_bf16"]["losses"], strict=True):
        assert b == pytest.approx(a, rel=2e-2)
    assert results[0]["zero3_bf16"]["losses"] != ddp, "bf16 had no effect"


@pytest.mark.slow
def test_zero_stages_match_ddp_on_four_ranks():
    variants = {k: VARIANTS[k] for k in ("ddp", "zero1", "zero2", "zero3", "zero3_offload")}
    results = run_distributed(_run_variants, 4, args=(_config(steps=4), variants), timeout=300)
    ddp = results[0]["ddp"]["losses"]
    for name in variants:
        for a, b in zip(ddp, results[0][name]["losses"], strict=True):
            assert b == pytest.approx(a, rel=1e-5), name
    _check_memory(results, 4, variants)


def _uneven(config: dict) -> list[dict]:
    data = json.loads(json.dumps(config))
    data["parallel"] = {"zero_stage": 3}
    result = train(TrainConfig.from_dict(data))
    from torsh_distributed.models.gpt import GPT

    shapes = [tuple(p.shape) for p in GPT(TrainConfig.from_dict(data).model).parameters()]
    return [result.memory, shapes]


@pytest.mark.slow
def test_uneven_shards_report_their_padding():
    # block_size 66: the position embedding's 66 rows do not divide by 4 ranks
    results = run_distributed(_uneven, 4, args=(_config(steps=2, block_size=66),), timeout=240)
    shapes = results[0][1]
    world = 4
    num_params = sum(math.prod(s) for s in shapes)
    padded = sum(math.ceil(s[0] / world) * world * math.prod(s[1:]) for s in shapes)
    assert padded > num_params, "the test model must have an uneven shard"
    formula = model_state_bytes(num_params, world, 3, dtype="fp32", layout="fsdp2")
    padding_total = 0
    for memory, _ in results:
        measured = memory["model_state_bytes_per_rank"]
        # every rank stores ceil(rows / world) rows of every parameter (and gradient)
        assert measured["params"] == 4 * padded // world
        assert measured["grads"] == 4 * padded // world
        assert measured["params"] - formula.params == 4 * (padded - num_params) // world
        padding_total += measured["padding"]["params"]
    # the reported padding is exactly the rows no rank owns
    assert padding_total == 4 * (padded - num_params)


def _summary(config: dict, path: str) -> None:
    data = json.loads(json.dumps(config))
    data["parallel"] = {"zero_stage": 2}
    data["summary_json"] = path
    train(TrainConfig.from_dict(data))


def test_summary_json_has_memory(tmp_path):
    out = tmp_path / "summary.json"
    run_distributed(_summary, 2, args=(_config(steps=2), str(out)), timeout=120)
    memory = json.loads(out.read_text())["memory"]
    assert memory["zero_stage"] == 2
    assert set(memory["model_state_bytes_per_rank"]) >= {"params", "grads", "optimizer", "total"}
    assert memory["peak_rss_bytes"] >= memory["baseline_rss_bytes"] > 0
    assert memory["predicted_peak_rss_bytes"] > memory["baseline_rss_bytes"]


def _stage3_alone(config: dict) -> str:
    data = json.loads(json.dumps(config))
    data["parallel"] = {"zero_stage": 3}
    try:
        train(TrainConfig.from_dict(data))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_zero_stage_with_one_rank_is_rejected():
    message = run_distributed(_stage3_alone, 1, args=(_config(steps=1),), timeout=60)[0]
    assert "zero_stage 3 shards model states across data-parallel ranks" in message
