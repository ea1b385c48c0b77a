"""Strategy planner, profiled mode: FSDP2's measured overhead and the pipeline stage's optimizer.

The profile's ``fsdp_block`` / ``fsdp_root`` hold what a block and the root unit took under FSDP2
beyond the plain model (``benchmarks/bench_planner.py`` measures them Galvatron-style); where
they apply they replace the raw collective fits of ZeRO-2/3, and only there. The numbers below
are synthetic: each test checks one formula of docs/planner.md against hand arithmetic.
"""

from __future__ import annotations

import json

import pytest

from torsh_distributed.plan.profile import Collective, Profile
from torsh_distributed.plan.strategy import StrategyConfig, evaluate_layout, plan_strategy

_CPU = dict(
    params=1e6,
    layers=4,
    hidden=128,
    heads=4,
    seq_len=64,
    vocab=256,
    devices=2,
    device_memory=1e12,
    intra_bw=1e9,
    inter_bw=1e9,
    global_batch=8,
    dtype="fp32",
    device="cpu",
    device_flops=1e10,
    layout="fsdp2",
    reserve=0,
)
# the raw fits' ZeRO-3 at one micro-batch: 5 units (4 blocks + root), 4 MB of fp32 parameters,
# one reduce-scatter and two all-gathers
_RS = 5 * 2e-3 + 4e6 * 2e-9
_RAW_Z3 = _RS + 2 * (5 * 3e-3 + 4e6 * 3e-9)


def _profile(**changes: object) -> Profile:
    fields = dict(
        hidden=128,
        seq_len=64,
        ranks=2,
        block={1: {4: 0.1, 8: 0.2}, 2: {8: 0.15}},
        outside={1: {4: 0.01, 8: 0.02}, 2: {8: 0.03}},
        optimizer={1: 1e-8, 2: 2e-8},
        optimizer_sharded=3e-8,
        optimizer_pipeline=5e-8,
        fsdp_block={3: {4: 0.04, 8: 0.06}},
        fsdp_root={3: {4: 0.01, 8: 0.012}},
        all_reduce=Collective(alpha=1e-3, beta=1e-9),
        reduce_scatter=Collective(alpha=2e-3, beta=2e-9),
        all_gather=Collective(alpha=3e-3, beta=3e-9),
        p2p=Collective(alpha=4e-4, beta=4e-9),
    )
    return Profile(**{**fields, **changes})


def _time(cfg: StrategyConfig, **layout: object) -> dict[str, float]:
    return evaluate_layout(cfg, **layout).estimate.time


def test_zero3_uses_the_measured_fsdp_overhead() -> None:
    t = _time(StrategyConfig(**_CPU, profile=_profile()), dp=2, stage=3, micro_batch=4)
    assert t["dp_comm"] == pytest.approx(4 * 0.04 + 0.01)  # 4 blocks + the root, 1 micro-batch
    assert t["dp_comm"] != pytest.approx(_RAW_Z3)
    assert t["compute"] == pytest.approx(4 * 0.1 + 0.01)  # the plain profile, as before
    assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"))
    # without the FSDP2 tables the same profile falls back to the raw collective fits
    bare = _profile(fsdp_block={}, fsdp_root={})
    t = _time(StrategyConfig(**_CPU, profile=bare), dp=2, stage=3, micro_batch=4)
    assert t["dp_comm"] == pytest.approx(_RAW_Z3)


def test_fsdp_overhead_is_per_stage() -> None:
    prof = _profile(fsdp_block={2: {4: 0.02}}, fsdp_root={2: {4: 0.005}})
    cfg = StrategyConfig(**_CPU, profile=prof)
    assert _time(cfg, dp=2, stage=2, micro_batch=4)["dp_comm"] == pytest.approx(4 * 0.02 + 0.005)
    assert _time(cfg, dp=2, stage=3, micro_batch=4)["dp_comm"] == pytest.approx(_RAW_Z3)
    # stages 0-1 are DDP: the all-reduce fit, whatever FSDP2 costs
    assert _time(cfg, dp=2, stage=0, micro_batch=4)["dp_comm"] == pytest.approx(1e-3 + 4e6 * 1e-9)


def test_accumulation_skips_all_but_one_reduce_scatter() -> None:
    cfg = StrategyConfig(**{**_CPU, "global_batch": 16}, profile=_profile())
    t = _time(cfg, dp=2, stage=3, micro_batch=4)  # 2 micro-batches per rank
    assert t["dp_comm"] == pytest.approx(2 * (4 * 0.04 + 0.01) - _RS)


def test_fsdp_overhead_is_interpolated_not_scaled() -> None:
    prof = _profile()
    assert prof.fsdp_overhead(3, 6) == pytest.approx((0.05, 0.011))  # between 4 and 8
    assert prof.fsdp_overhead(3, 2) == pytest.approx((0.04, 0.01))  # below: the nearest
    assert prof.fsdp_overhead(3, 64) == pytest.approx((0.06, 0.012))  # above: the nearest
    assert prof.fsdp_overhead(2, 4) is None
    cfg = StrategyConfig(**_CPU, profile=prof)
    assert _time(cfg, dp=2, stage=3, micro_batch=2)["dp_comm"] == pytest.approx(
        2 * (4 * 0.04 + 0.01) - _RS
    )


def test_fsdp_overhead_applies_only_where_it_was_measured() -> None:
    prof = _profile()
    four = {**_CPU, "devices": 4, "global_batch": 16}
    plain = StrategyConfig(**four, profile=_profile(fsdp_block={}, fsdp_root={}))
    cfg = StrategyConfig(**four, profile=prof)
    # tp 2 blocks hold other parameters than the profiled tp 1 block
    a = _time(plain, dp=2, tp=2, stage=3, micro_batch=8)
    assert _time(cfg, dp=2, tp=2, stage=3, micro_batch=8)["dp_comm"] == a["dp_comm"]
    # a 4-rank group: FSDP2 was profiled on 2 ranks
    a = _time(plain, dp=4, stage=3, micro_batch=4)
    assert _time(cfg, dp=4, stage=3, micro_batch=4)["dp_comm"] == a["dp_comm"]
    # the ZeRO paper's accounting models DeepSpeed, not this package's FSDP2
    paper = {**_CPU, "layout": "paper"}
    bare = StrategyConfig(**paper, profile=_profile(fsdp_block={}, fsdp_root={}))
    a = _time(bare, dp=2, stage=3, micro_batch=4)
    assert _time(StrategyConfig(**paper, profile=prof), dp=2, stage=3, micro_batch=4) == a


def test_measured_fsdp_overhead_decides_the_stage() -> None:
    def plan(block: float) -> tuple[str, str]:
        prof = _profile(
            fsdp_block={3: {4: block}}, fsdp_root={3: {4: 0.0}}, optimizer_sharded=0.5e-8
        )
        cfg = StrategyConfig(**_CPU, stages=(0, 3), pp=1, tp=1, profile=prof)
        result = plan_strategy(cfg)
        return result.best.name(), result.find(dp=2, tp=1, pp=1, stage=3).reason

    # ZeRO-0 costs the all-reduce (5 ms) and the full optimizer step (10 ms); ZeRO-3 the
    # sharded step (2.5 ms) and 4 x the block's overhead, at 1 micro-batch of 4
    assert plan(0.0001)[0] == "dp2 tp1 pp1 z3"
    best, reason = plan(0.05)
    assert best == "dp2 tp1 pp1 z0" and "dp comm +0.195 s" in reason


def test_pipeline_stage_steps_at_the_model_parallel_rate() -> None:
    cfg = StrategyConfig(**_CPU, profile=_profile())
    assert _time(cfg, dp=1, pp=2, micro_batch=2)["optimizer"] == pytest.approx(5e-8 * 0.5e6)
    assert _time(cfg, dp=2, micro_batch=4)["optimizer"] == pytest.approx(1e-8 * 1e6)
    assert _time(cfg, dp=1, tp=2, micro_batch=8)["optimizer"] == pytest.approx(2e-8 * 0.5e6)
    old = StrategyConfig(**_CPU, profile=_profile(optimizer_pipeline=None))
    assert _time(old, dp=1, pp=2, micro_batch=2)["optimizer"] == pytest.approx(1e-8 * 0.5e6)


def test_pipeline_fill_and_drain_run_at_the_speed_of_a_rank_alone() -> None:
    # 2 stages, m = 4 micro-batches of 2: of 5 slots, 3 run both stages, 2 (fill, drain) one
    # stage while the other waits: bubble = (2 r - 1) of one busy slot, r = solo / block
    busy = _time(StrategyConfig(**_CPU, profile=_profile()), dp=1, pp=2, micro_batch=2)
    slot = busy["compute"] / 4
    assert busy["bubble"] == pytest.approx(slot)  # no solo measured: the textbook (pp-1)/m
    cfg = StrategyConfig(**_CPU, profile=_profile(solo={4: 0.07}))  # 0.7 of block[1][4]
    t = _time(cfg, dp=1, pp=2, micro_batch=2)  # micro-batch 2 scaled from 4 in both tables
    assert t["compute"] == pytest.approx(busy["compute"])
    assert t["bubble"] == pytest.approx((2 * 0.7 - 1) * slot)
    assert t["total"] == pytest.approx(busy["total"] - 0.6 * slot)
    # tensor-parallel ranks always run together; layouts without a pipeline have no bubble
    assert _profile(solo={4: 0.07}).solo_ratio(2, 8) == 1.0
    assert _time(cfg, dp=2, micro_batch=4)["bubble"] == 0.0
    # a noisy solo above the busy time does not make the bubble longer than the textbook one
    assert _profile(solo={4: 0.2}).solo_ratio(1, 4) == 1.0
    with pytest.raises(ValueError, match="profile solo"):
        _profile(solo={4: 0.0})


def test_fsdp_profile_checks_and_round_trip() -> None:
    with pytest.raises(ValueError, match="keyed by ZeRO stage 2 or 3"):
        _profile(fsdp_block={1: {4: 0.1}}, fsdp_root={1: {4: 0.1}})
    with pytest.raises(ValueError, match="same stages and micro-batches"):
        _profile(fsdp_block={3: {4: 0.1}}, fsdp_root={3: {8: 0.1}})
    with pytest.raises(ValueError, match=r"profile fsdp_root\[3\]"):
        _profile(fsdp_root={3: {4: -0.1, 8: 0.0}})
    with pytest.raises(ValueError, match="optimizer_pipeline must be >= 0"):
        _profile(optimizer_pipeline=-1.0)
    prof = _profile(source="synthetic", solo={4: 0.07, 8: 0.15})
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
    # a profile written before the FSDP2 tables existed still loads, with none
    old = {
        k: v
        for k, v in prof.to_dict().items()
        if not k.startswith(("fsdp", "optimizer_p", "solo"))
    }
    assert Profile.from_dict(json.loads(json.dumps(old))).fsdp_overhead(3, 4) is None
