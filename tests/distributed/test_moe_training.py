"""The built-in GPT with MoE blocks through the engine: expert parallelism (ep=2, dp=2 x ep=2)
equals one process on the same global batch, and bad settings fail on every rank before any
collective."""

from __future__ import annotations

from typing import Any

import pytest

from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.configs import small_config

STEPS = 30


def _train(parallel: dict[str, Any], moe: dict[str, Any], steps: int = STEPS) -> dict[str, Any]:
    from torsh_distributed.train import TrainConfig, train

    data = small_config(steps=steps).to_dict()
    data["moe"].update(moe)
    data["parallel"].update(parallel)
    result = train(TrainConfig.from_dict(data))
    return {"losses": result.losses, "val": result.val_loss, "moe": result.moe}


def _error(parallel: dict[str, Any], moe: dict[str, Any]) -> str:
    try:
        _train(parallel, moe, steps=1)
    except ValueError as exc:
        return str(exc)
    return "no error"


MOE = {"num_experts": 4, "top_k": 2, "aux_loss_coef": 0.01, "z_loss_coef": 1e-3}


@pytest.mark.slow
def test_expert_parallel_training_equals_one_process():
    one = run_distributed(_train, 1, args=({}, MOE), timeout=180)[0]
    ep2 = run_distributed(_train, 2, args=({"ep": 2}, MOE), timeout=240)
    dp_ep = run_distributed(_train, 4, args=({"ep": 2}, MOE), timeout=300)
    assert ep2[0]["losses"] == ep2[1]["losses"]
    for run in (ep2[0], dp_ep[0]):
        assert run["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert run["val"] == pytest.approx(one["val"], rel=1e-5)
    assert one["losses"][-1] < one["losses"][0] - 0.3, "the MoE model did not learn"
    # every routed slot is counted once over all ranks: tokens x top_k per layer and step
    tokens = 8 * 32 * STEPS  # global batch x block size x steps
    for run in (one, ep2[0], dp_ep[0]):
        assert run["moe"]["layers"] == 4 and run["moe"]["dropped_share"] == 0.0
        for layer in run["moe"]["per_layer"]:
            assert sum(layer["tokens_per_expert"]) == tokens * 2
    assert dp_ep[0]["moe"]["ep"] == 2


def test_expert_parallel_with_fsdp_equals_one_process():
    """ep=2 with ZeRO-3 (FSDP2 over the dp x ep ranks for the dense parameters, experts out of
    it), gradient clipping on: the same losses as one process."""
    one = run_distributed(_train, 1, args=({}, MOE, 6), timeout=180)[0]
    ep_zero3 = run_distributed(_train, 2, args=({"ep": 2, "zero_stage": 3}, MOE, 6), timeout=240)
    assert ep_zero3[0]["losses"] == ep_zero3[1]["losses"]
    assert ep_zero3[0]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert ep_zero3[0]["val"] == pytest.approx(one["val"], rel=1e-5)


@pytest.mark.slow
def test_dp_ep_with_zero2_equals_one_process():
    one = run_distributed(_train, 1, args=({}, MOE, 6), timeout=180)[0]
    run = run_distributed(_train, 4, args=({"ep": 2, "zero_stage": 2}, MOE, 6), timeout=300)[0]
    assert run["losses"] == pytest.approx(one["losses"], rel=1e-5)


def test_capacity_drops_are_counted_and_conserved():
    moe = {**MOE, "capacity_factor": 0.5}
    r = run_distributed(_train, 2, args=({"ep": 2}, moe, 3), timeout=180)[0]
    assert 0.4 < r["moe"]["dropped_share"] < 0.7  # half the capacity of an even split


@pytest.mark.parametrize(
    ("parallel", "moe", "message"),
    [
        ({"ep": 2}, {"num_experts": 3, "top_k": 2}, "num_experts (3) of an MoE layer is not divisible by parallel.ep (2)"),
        ({"ep": 2}, {}, "parallel.ep=2 shards MoE experts, but GPT has no MoE layer"),
        ({"ep": 4}, MOE, "parallel degrees do not match the world size"),
    ],
)
def test_bad_settings_fail_on_every_rank_before_any_collective(parallel, moe, message):
    for msg in run_distributed(_error, 2, args=(parallel, moe), timeout=90):
        assert message in msg, msg


def test_config_errors_name_the_field():
    from torsh_distributed.models.config import MoESection
    from torsh_distributed.parallel.config import ParallelConfig

    with pytest.raises(ValueError, match=r"moe.top_k \(5\) must not exceed moe.num_experts \(4\)"):
        MoESection(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="moe.capacity_factor must be >= 0"):
        MoESection(num_experts=4, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="parallel.ep must be >= 1"):
        ParallelConfig(ep=0)
    with pytest.raises(ValueError, match=r"parallel.ep=2 combines with DDP \(zero_stage 0\) or FSDP2"):
        ParallelConfig(ep=2, zero_stage=1)
    with pytest.raises(ValueError, match="parallel.ep=2 combines with"):
        ParallelConfig(ep=2, tp=2)
    with pytest.raises(ValueError, match="parallel.meta_init with ep=2 and zero_stage 3"):
        ParallelConfig(ep=2, zero_stage=3, meta_init=True)
    with pytest.raises(ValueError, match="ep_rebalance_every and parallel.ep_rebalance_threshold"):
        ParallelConfig(ep=2, ep_rebalance_every=-1)
    with pytest.warns(UserWarning, match="ep_rebalance_every is ignored with ep=1"):
        ParallelConfig(ep_rebalance_every=5)
