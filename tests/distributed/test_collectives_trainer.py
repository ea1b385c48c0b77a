"""The trainer with gradients all-reduced through the facade (DDP comm hook) and --trace."""

from __future__ import annotations

import json

import pytest

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train


def _config(**comm) -> dict:
    cfg = preset("tiny")
    cfg.max_steps = 4
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 300_000
    data = cfg.to_dict()
    data["comm"].update(comm)
    return data


def _train(config_dict: dict) -> list[float]:
    return train(TrainConfig.from_dict(config_dict)).losses


@pytest.mark.slow
def test_facade_hook_matches_ddp_and_writes_merged_trace(tmp_path):
    trace = tmp_path / "trace.json"
    plain = run_distributed(_train, 2, args=(_config(),), timeout=180)[0]
    hooked = run_distributed(
        _train, 2, args=(_config(algorithm="ring", trace=str(trace)),), timeout=180
    )[0]
    assert len(plain) == len(hooked) == 4
    for step, (a, b) in enumerate(zip(plain, hooked, strict=True)):
        assert b == pytest.approx(a, rel=1e-4), f"step {step + 1}: DDP {a} vs facade {b}"
    events = json.loads(trace.read_text())["traceEvents"]
    comm = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in comm} == {0, 1}
    assert {e["args"]["algorithm"] for e in comm if e["name"] == "all_reduce"} == {"ring"}
