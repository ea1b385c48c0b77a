"""``device_profile.time_kernels`` in a 2-rank group measures FSDP2's own cost per unit for a
ZeRO-3 layout, and ``summarise`` turns the ranks' differences into the profile's fields."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.testing import run_distributed

SPEC = {
    "gemms": [],
    "act": 4,
    "repeats": 2,
    "tokens": 64,
    "hidden": 64,
    "ffn": 256,
    "attention": (1, 2, 64, 32),
    "optimizer_tensors": [64 * 64] * 4 + [64] * 8,
}


def _time(fsdp: bool) -> dict:
    from torsh_distributed.plan.device_profile import time_kernels

    torch.set_num_threads(1)
    out = time_kernels({**SPEC, "fsdp": fsdp}, dist.barrier)
    return out


@pytest.mark.timeout(180)
def test_fsdp_unit_cost_is_measured_in_a_group_and_summarised() -> None:
    from torsh_distributed.plan.device_profile import from_dict, summarise

    ranks = run_distributed(_time, 2, args=(True,), timeout=150)
    keys = {"fsdp_forward_s", "fsdp_backward_s", "fsdp_optimizer_s", "fsdp_raw_gather_s"}
    for out in ranks:
        assert keys <= set(out), out.keys()
        assert out["fsdp_raw_gather_s"] > 0 and out["fsdp_raw_scatter_s"] > 0
    # summarise: the mean of the ranks' differences, clamped at 0 (noise is not a negative cost)
    ranks[0]["fsdp_optimizer_s"], ranks[1]["fsdp_optimizer_s"] = -0.004, 0.002
    prof = summarise(SPEC, ranks, source="test", dtype="fp32")
    assert prof["fsdp_optimizer_s"] == 0.0
    expected = (ranks[0]["fsdp_backward_s"] + ranks[1]["fsdp_backward_s"]) / 2
    assert prof["fsdp_backward_s"] == pytest.approx(max(expected, 0.0))
    assert from_dict(prof).fsdp_backward_s == prof["fsdp_backward_s"]
    # without the layout asking for it, or outside a group, nothing is measured
    plain = run_distributed(_time, 2, args=(False,), timeout=150)
    assert not [k for k in plain[0] if k.startswith("fsdp")]
