"""The GPU power-limit control (``--energy.power-limit``): the search's order of limits, its
windows, the job cost across ranks, the limit applied and restored, a refusal on any rank, and the
tracker's report. NVML is faked at the library boundary only (the five pynvml calls used): a
simulated GPU whose step time and power follow its limit, driven step by step by the test."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from torsh_distributed.energy import CarbonConfig, EnergyConfig, EnergyTracker
from torsh_distributed.energy.power import (
    WARMUP_STEPS,
    PowerLimit,
    candidate_limits,
    choose_limit,
    parse_power_limit,
)


class FakeGpu:
    """pynvml's power-limit and energy calls over a simulated GPU: a step at limit P takes
    ``work / min(P, demand)**alpha``-shaped time and draws ``min(P, demand)`` watts."""

    def __init__(self, *, min_w: float = 100, max_w: float = 400, demand_w: float = 350,
                 alpha: float = 0.4, denied: bool = False) -> None:
        self.min_mw, self.max_mw = int(min_w * 1000), int(max_w * 1000)
        self.limit_mw = self.max_mw
        self.demand_w, self.alpha, self.denied = demand_w, alpha, denied
        self.mj = 5_000_000.0
        self.now = 100.0
        self.history: list[int] = []

    def step_cost(self, limit_w: float) -> tuple[float, float]:
        watts = min(limit_w, self.demand_w)
        seconds = 0.1 * (self.demand_w / watts) ** self.alpha
        return watts * seconds, seconds

    def step(self) -> None:
        joules, seconds = self.step_cost(self.limit_mw / 1000)
        self.mj += joules * 1000
        self.now += seconds

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: Any) -> tuple[int, int]:  # noqa: N802
        return self.min_mw, self.max_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:  # noqa: N802
        return self.limit_mw

    def nvmlDeviceSetPowerManagementLimit(self, handle: Any, mw: int) -> None:  # noqa: N802
        if self.denied:
            raise RuntimeError("NVMLError_NoPermission: Insufficient Permissions")
        assert self.min_mw <= mw <= self.max_mw, mw
        self.limit_mw = mw
        self.history.append(mw)


def thread_gathers(n: int) -> Any:
    """``gather_for(rank)``: an all-gather among ``n`` threads (each rank's control in its own
    thread), standing in for the process group's ``all_gather_object``."""
    barrier = threading.Barrier(n)
    box: list[Any] = [None] * n

    def gather_for(rank: int) -> Any:
        def gather(obj: Any) -> list[Any]:
            box[rank] = obj
            barrier.wait(timeout=10)
            out = list(box)
            barrier.wait(timeout=10)  # nobody overwrites the box before everyone has read it
            return out
        return gather

    return gather_for


def control(gpu: FakeGpu, *, limit: str = "search", gather: Any = None, **kw: Any) -> PowerLimit:
    args: dict[str, Any] = dict(limit_w=parse_power_limit(limit), tradeoff=0.5, steps=3, stride_w=100.0,
                                clock=lambda: gpu.now)
    args.update(kw)
    if gather is not None:
        args["gather"] = gather
    return PowerLimit(gpu, "h0", lambda: gpu.mj / 1000, **args)


def drive(ctl: PowerLimit, gpu: FakeGpu, steps: int) -> None:
    for _ in range(steps):
        gpu.step()
        ctl.step_end()


def test_parse_and_candidates():
    assert parse_power_limit("off") is None
    assert math.isnan(parse_power_limit("search"))  # type: ignore[arg-type]
    assert parse_power_limit("250W") == 250.0
    for bad in ("fast", "-5", "0", "nan"):
        with pytest.raises(ValueError, match="energy.power_limit"):
            parse_power_limit(bad)
    assert candidate_limits(100, 400, 100) == [400, 300, 200, 100]
    assert candidate_limits(150, 400, 100) == [400, 300, 200, 150]


def test_search_profiles_each_limit_then_applies_the_least_cost_and_restores():
    gpu = FakeGpu()
    gpu.limit_mw = 380_000  # the operator's limit before the run
    ctl = control(gpu)
    ctl.start()
    per_limit = WARMUP_STEPS + 3
    drive(ctl, gpu, per_limit * 4)
    assert not ctl.active
    # computed independently from the simulated GPU's model
    costs = {}
    for watts in (400, 300, 200, 100):
        joules, seconds = gpu.step_cost(watts)
        costs[watts] = 0.5 * joules + 0.5 * 400 * seconds
    best = min(costs, key=costs.__getitem__)
    assert best not in (400,), "the model makes a lower limit cheaper"
    report = ctl.report
    assert report["applied"] and report["limit_w"] == best
    assert gpu.history == [400_000, 300_000, 200_000, 100_000, best * 1000]
    for row in report["candidates"]:
        joules, seconds = gpu.step_cost(row["limit_w"])
        assert row["joules_per_step"] == pytest.approx(joules)
        assert row["seconds_per_step"] == pytest.approx(seconds)
    assert report["energy_saved"] == pytest.approx(1 - gpu.step_cost(best)[0] / gpu.step_cost(400)[0])
    drive(ctl, gpu, 5)  # after the search: no more changes
    assert gpu.history[-1] == best * 1000
    ctl.restore()
    assert gpu.limit_mw == 380_000 and len(gpu.history) == 6
    ctl.restore()  # idempotent
    assert len(gpu.history) == 6


def test_tradeoff_zero_keeps_the_fastest_limit():
    gpu = FakeGpu()
    ctl = control(gpu, tradeoff=0.0)
    ctl.start()
    drive(ctl, gpu, (WARMUP_STEPS + 3) * 4)
    assert ctl.report["limit_w"] == 400  # 350 W demand: 400 W is as fast as any, and first on ties


def test_a_refusal_on_any_rank_changes_no_limit():
    gpus = [FakeGpu(), FakeGpu(denied=True)]
    gather_for = thread_gathers(2)
    ctls = [control(g, gather=gather_for(r)) for r, g in enumerate(gpus)]
    threads = [threading.Thread(target=c.start) for c in ctls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    for ctl, gpu in zip(ctls, gpus, strict=True):
        assert not ctl.active and ctl.report["applied"] is False
        assert "rank 1: RuntimeError: NVMLError_NoPermission" in ctl.report["why"]
        assert gpu.limit_mw == gpu.max_mw  # rank 0 was set to 400 W (its max) and put back
    assert gpus[0].history == [400_000, 400_000]


def test_two_ranks_agree_on_the_job_cost():
    # rank 1's GPU is slow at low limits: the job (as fast as its slowest rank) keeps a higher one
    gpus = [FakeGpu(alpha=0.1), FakeGpu(alpha=2.0)]
    gather_for = thread_gathers(2)
    ctls = [control(g, gather=gather_for(r)) for r, g in enumerate(gpus)]

    def run(rank: int) -> None:
        ctls[rank].start()
        drive(ctls[rank], gpus[rank], (WARMUP_STEPS + 3) * 4)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    limits = [400, 300, 200, 100]
    per_rank = [[g.step_cost(w) for w in limits] for g in gpus]
    best, _ = choose_limit(limits, per_rank, tradeoff=0.5, max_power_w=800)
    alone, _ = choose_limit(limits, per_rank[:1], tradeoff=0.5, max_power_w=400)
    assert limits[best] != limits[alone], "the test's GPUs must disagree alone"
    for ctl, gpu in zip(ctls, gpus, strict=True):
        assert ctl.report["limit_w"] == limits[best]
        assert gpu.limit_mw == limits[best] * 1000


def test_a_fixed_limit_is_set_checked_and_restored():
    gpu = FakeGpu()
    with pytest.raises(ValueError, match=r"450 W is outside this GPU's range 100\.\.400 W"):
        control(gpu, limit="450")
    ctl = control(gpu, limit="250")
    ctl.start()
    assert not ctl.active and ctl.report == {"mode": "fixed", "range_w": [100.0, 400.0], "original_w": 400.0,
                                             "applied": True, "limit_w": 250.0}
    assert gpu.limit_mw == 250_000
    ctl.restore()
    assert gpu.limit_mw == 400_000


def test_config_checks_and_the_tracker_refuses_without_nvml():
    for kw, match in (
        ({"power_limit": "fast"}, "energy.power_limit must be off, search"),
        ({"power_limit": "search", "meter": "estimate"}, "use --energy.meter nvml or auto"),
        ({"power_tradeoff": 1.5}, r"power_tradeoff must be in \[0, 1\]"),
        ({"power_steps": 0}, "power_steps must be >= 1"),
        ({"power_stride_w": 0.0}, "power_stride_w must be > 0"),
    ):
        with pytest.raises(ValueError, match=match):
            EnergyConfig(**kw)
    with pytest.raises(ValueError, match="needs the NVML meter of a CUDA rank; rank 0 meters with estimate"):
        EnergyTracker(EnergyConfig(power_limit="search", meter="auto", powercap_root="/nonexistent"),
                      CarbonConfig(intensity=100.0))


def test_the_tracker_runs_the_search_and_reports_it(monkeypatch: pytest.MonkeyPatch):
    from torsh_distributed.energy.nvml import NvmlMeter

    gpu = FakeGpu()
    gpu.nvmlDeviceGetHandleByIndex = lambda index: "h0"  # type: ignore[attr-defined]
    gpu.nvmlDeviceGetTotalEnergyConsumption = lambda handle: int(gpu.mj)  # type: ignore[attr-defined]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    meter = NvmlMeter(0, nvml=gpu)
    tracker = EnergyTracker(EnergyConfig(power_limit="search", power_steps=3, power_stride_w=150.0),
                            CarbonConfig(intensity=100.0), meter=meter, clock=lambda: gpu.now)
    assert tracker.power is not None
    tracker.power._clock = lambda: gpu.now  # the simulated GPU's time, not the host's
    tracker.start()
    for _ in range((WARMUP_STEPS + 3) * 3 + 2):  # 400, 250, 100 W, then two steps at the choice
        gpu.step()
        tracker.step_end()
    energy, _ = tracker.finish(gather=lambda row: [row])
    block = energy["power_limit"]
    assert block["mode"] == "search" and block["applied"]
    assert [c["limit_w"] for c in block["candidates"]] == [400, 250, 100]
    assert "power_limit" not in energy["ranks"][0]
    assert gpu.limit_mw == 400_000, "restored at the end of the run"
    from torsh_distributed.energy.report import format_report

    text = format_report({"energy": energy, "carbon": {}})
    assert f"power:   GPU limit {block['limit_w']:.4g} W (search; was 400 W)" in text
    assert text.count("<- chosen") == 1
    refused = dict(block, applied=False, why="NVML refused to set the power limit: rank 0: X")
    assert "limit unchanged (NVML refused" in format_report({"energy": {**energy, "power_limit": refused}})
