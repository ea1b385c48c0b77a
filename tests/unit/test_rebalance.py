"""Expert placement and moves on one process: the plan balances ranks deterministically, and a
layer whose experts moved (weights and Adam state) computes and trains bit-identically."""

from __future__ import annotations

import copy

import pytest
import torch

from torsh_distributed.parallel.moe import MoE, MoEConfig
from torsh_distributed.parallel.rebalance import (
    ExpertRebalancer,
    RebalanceConfig,
    move_experts_,
    plan_placement,
    rank_load_cv,
)


def test_plan_splits_the_busy_experts_and_keeps_the_rest_in_place():
    load = torch.tensor([10.0, 9.0, 1.0, 1.0])
    assert rank_load_cv(load, torch.arange(4), 2) == pytest.approx(17 / 21)
    slot = plan_placement(load, 2)
    assert slot[0] // 2 != slot[1] // 2
    assert rank_load_cv(load, slot, 2) == pytest.approx(1 / 21)
    assert sorted(slot.tolist()) == [0, 1, 2, 3]
    assert torch.equal(plan_placement(load, 2), slot)  # deterministic
    assert rank_load_cv(torch.ones(8), plan_placement(torch.ones(8), 4), 4) == 0.0
    # experts staying on their rank keep their slot: expert 0 stays in slot 0
    assert int(slot[0]) == 0


def test_plan_checks_its_input():
    with pytest.raises(ValueError, match="divisible by ep"):
        plan_placement(torch.ones(6), 4)
    with pytest.raises(ValueError, match="ep must be an int >= 1"):
        rank_load_cv(torch.ones(4), torch.arange(4), 0)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        RebalanceConfig(every=0)
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        RebalanceConfig(every=1, threshold=-1.0)


def _layer() -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(num_experts=4, d_model=8, d_hidden=16, top_k=2, capacity_factor=1.0)).double()


def _step(layer: MoE, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    opt.zero_grad()
    loss = layer(x).square().mean() + layer.loss
    loss.backward()
    opt.step()
    return float(loss)


def test_moved_experts_train_bit_identically():
    a = _layer()
    b = copy.deepcopy(a)
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    xs = [torch.randn(32, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    for x in xs[:3]:
        assert _step(a, opt_a, x) == _step(b, opt_b, x)
    w1 = b.experts.w1.detach().clone()
    moment = opt_b.state[b.experts.w1]["exp_avg"].clone()
    slot = torch.tensor([2, 0, 3, 1])
    assert move_experts_(b, slot, opt_b) == 4
    assert torch.equal(b.expert_slot, slot)
    for e in range(4):  # expert e's weights and Adam moment now live in row slot[e]
        assert torch.equal(b.experts.w1[slot[e]], w1[e])
        assert torch.equal(opt_b.state[b.experts.w1]["exp_avg"][slot[e]], moment[e])
    for x in xs[3:]:
        assert _step(a, opt_a, x) == _step(b, opt_b, x)
        assert a.stats.tokens_per_expert == b.stats.tokens_per_expert  # by expert id, not slot
    assert move_experts_(b, slot, opt_b) == 0  # already there
    with pytest.raises(ValueError, match="permutation"):
        move_experts_(b, torch.tensor([0, 0, 1, 2]))


def test_the_rebalancer_acts_only_on_a_skewed_window():
    layer = _layer()
    layer.expert_bias.copy_(torch.tensor([1.0, 1.0, -1.0, -1.0]))  # selection: experts 0 and 1
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    rebalancer = ExpertRebalancer(layer, opt, config=RebalanceConfig(every=2), ep=2)
    x = torch.randn(16, 8, dtype=torch.float64)
    _step(layer, opt, x)
    assert not rebalancer.step() and not rebalancer.history  # mid-window: nothing happens
    _step(layer, opt, x)
    assert rebalancer.step()
    assert rebalancer.history[0]["cv_before"] == pytest.approx(1.0)
    assert rebalancer.history[0]["cv_after"] == pytest.approx(0.0)  # top-2 of 2: equal loads
    assert layer.expert_slot[0] // 2 != layer.expert_slot[1] // 2
    for _ in range(2):
        _step(layer, opt, x)
    assert not rebalancer.step(4)  # balanced now: no further move
    assert rebalancer.moves == 1
