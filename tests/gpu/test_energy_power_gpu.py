"""The power-limit search on a real GPU: the NVML calls, the windows around real work, and the
limit put back afterwards. Where NVML refuses to set a limit (no administrator rights), the
report must say so and nothing may change. Skipped without CUDA or nvidia-ml-py; written
without a lent GPU (2026-11-26): run it with ``pytest tests/gpu`` where one is."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]


def test_power_limit_search_on_real_work_restores_the_limit():
    pynvml = pytest.importorskip("pynvml", reason="pip install 'torsh-distributed[energy]'")
    from torsh_distributed.energy import CarbonConfig, EnergyConfig, EnergyTracker

    device = torch.device("cuda", torch.cuda.current_device())
    tracker = EnergyTracker(
        EnergyConfig(meter="nvml", power_limit="search", power_steps=4, power_stride_w=150.0),
        CarbonConfig(intensity=100.0), device=device,
    )
    assert tracker.power is not None
    handle = tracker.meter.handle  # type: ignore[attr-defined]
    before = pynvml.nvmlDeviceGetPowerManagementLimit(handle)
    a = torch.randn(8192, 8192, device=device)
    tracker.start()
    steps = 0
    while tracker.power.active and steps < 200:
        for _ in range(4):
            a = (a @ a).clamp_(-1, 1)
        tracker.step_end()
        steps += 1
    energy, _ = tracker.finish(gather=lambda row: [row])
    block = energy["power_limit"]
    if block["applied"]:
        limits = [c["limit_w"] for c in block["candidates"]]
        assert limits == sorted(limits, reverse=True) and block["limit_w"] in limits
        assert all(c["joules_per_step"] > 0 and c["seconds_per_step"] > 0 for c in block["candidates"])
    else:
        assert "NVML refused" in block["why"]
    assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == before
