"""Tensor parallelism (and dp x tp, tp x pp) trains the built-in model exactly like one process.

Same seed, same global batch: the per-step global losses and the validation loss of TP=2 (with
vocabulary-parallel embedding and loss-parallel cross-entropy), dp2 x tp2 (gradient all-reduce
and FSDP2 over dp), tp2 x pp2 and dp2 x tp2 x pp2 (FSDP2 over dp) must
equal those of a one-process run within 1e-4 relative (fp32 CPU). One spawn per world size; the
4- and 8-rank runs (dp2 x tp2 x pp2) are marked slow.
"""

from __future__ import annotations

import json

import pytest
import torch

from torsh_distributed.parallel._trainer_mp import check_model_parallel
from torsh_distributed.parallel.tensor import check_tp, qkv_permutation
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

REL = 1e-4


def _config(steps: int = 4) -> dict:
    cfg = preset("tiny")
    cfg.max_steps = steps
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 200_000
    cfg.model.n_layer = 4
    cfg.model.block_size = 32
    cfg.model.d_model = 32
    return cfg.to_dict()


def _run(variants: dict[str, dict]) -> dict[str, tuple[list[float], float]]:
    out = {}
    for name, parallel in variants.items():
        data = json.loads(json.dumps(_config()))
        data["parallel"] = parallel
        result = train(TrainConfig.from_dict(data))
        out[name] = (result.losses, result.val_loss)
    return out


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], float]:
    return run_distributed(_run, 1, args=({"one": {}},), timeout=180)[0]["one"]


def _check(results: list[dict], reference: tuple[list[float], float]) -> None:
    losses, val = reference
    assert losses[-1] < losses[0], "the loss did not fall"
    for name in results[0]:
        for rank_result in results[1:]:
            assert rank_result[name] == results[0][name], f"{name}: ranks disagree"
        got, got_val = results[0][name]
        assert len(got) == len(losses)
        for step, (a, b) in enumerate(zip(losses, got, strict=True)):
            assert b == pytest.approx(a, rel=REL), f"{name}, step {step + 1}"
        assert got_val == pytest.approx(val, rel=REL), f"{name}: validation loss"


def test_tp2_matches_one_process(reference: tuple[list[float], float]) -> None:
    results = run_distributed(_run, 2, args=({"tp2": {"tp": 2}},), timeout=240)
    _check(results, reference)


@pytest.mark.slow
def test_dp2_tp2_fsdp_and_tp2_pp2_match_one_process(reference: tuple[list[float], float]) -> None:
    variants = {
        "dp2xtp2": {"dp": 2, "tp": 2},
        "dp2xtp2_fsdp": {"dp": 2, "tp": 2, "zero_stage": 3},
        "tp2xpp2": {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
    }
    results = run_distributed(_run, 4, args=(variants,), timeout=420)
    _check(results, reference)


@pytest.mark.slow
def test_dp2_tp2_pp2_at_8_ranks_matches_one_process(reference: tuple[list[float], float]) -> None:
    variants = {"dp2xtp2xpp2_fsdp": {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "zero_stage": 3}}
    results = run_distributed(_run, 8, args=(variants,), timeout=480)
    _check(results, reference)


def test_qkv_permutation_groups_heads_per_rank() -> None:
    perm = qkv_permutation(4, 2)  # q = rows 0-3, k = 4-7, v = 8-11
    assert perm.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert torch.equal(perm[perm.argsort()], torch.arange(12))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 4, "n_head": 2, "d_model": 64}, r"tp=4 must divide model.n_head=2"),
        ({"tp": 3, "n_head": 3, "d_model": 63, "vocab_size": 256}, r"vocab_size=256"),
    ],
)
def test_tp_shapes_not_divisible(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_tp(**kwargs)


def test_degrees_must_match_world_size() -> None:
    cfg = TrainConfig.from_dict({**_config(), "parallel": {"tp": 2, "dp": 2}})
    with pytest.raises(ValueError, match=r"degrees do not match the world size.*!= world size 2"):
        check_model_parallel(cfg, 2)
    cfg = TrainConfig.from_dict({**_config(), "parallel": {"dp": 3}})
    with pytest.raises(ValueError, match=r"degrees do not match the world size"):
        check_model_parallel(cfg, 2)
    assert (
        check_model_parallel(TrainConfig.from_dict({**_config(), "parallel": {"tp": 2}}), 4).dp == 2
    )


def test_tp_rejects_zero1_and_sharding_without_dp() -> None:
    with pytest.raises(ValueError, match=r"not yet with zero_stage 1"):
        TrainConfig.from_dict({**_config(), "parallel": {"tp": 2, "zero_stage": 1}})
    cfg = TrainConfig.from_dict({**_config(), "parallel": {"tp": 2, "zero_stage": 3}})
    with pytest.raises(ValueError, match=r"shards over the dp axis, but dp = 1"):
        check_model_parallel(cfg, 2)
