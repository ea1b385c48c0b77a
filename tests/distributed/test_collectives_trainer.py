"""The trainer with gradients all-reduced through the facade (DDP comm hook) and --trace."""

from __future__ import annotations

import json

import pytest

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train


def _config(compression: str = "none", **comm) -> dict:
    cfg = preset("tiny")
    cfg.compression.method = compression
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


def _train_compressed(trace: str) -> dict:
    out = {}
    for name, comm in (("torch", {}), ("ring", {"algorithm": "ring", "trace": trace})):
        result = train(TrainConfig.from_dict(_config("powersgd:2", **comm)))
        out[name] = (result.losses, result.compression["bytes_sent"])
    return out


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


def test_compression_sums_through_the_facade_algorithm(tmp_path):
    """--compression powersgd:2 --comm.algorithm ring: the compression hook (DDP's one hook)
    sums its factors with the facade's ring; same losses as with torch's all-reduce."""
    trace = tmp_path / "trace.json"
    r = run_distributed(_train_compressed, 2, args=(str(trace),), timeout=180)[0]
    (plain, plain_bytes), (ring, ring_bytes) = r["torch"], r["ring"]
    assert plain_bytes == ring_bytes > 0
    for step, (a, b) in enumerate(zip(plain, ring, strict=True)):
        assert b == pytest.approx(a, rel=1e-4), f"step {step + 1}: torch {a} vs ring {b}"
    events = json.loads(trace.read_text())["traceEvents"]
    ring_calls = [
        e
        for e in events
        if e.get("ph") == "X" and e["name"] == "all_reduce" and e["args"]["algorithm"] == "ring"
    ]
    # two rounds (P, then Q) per bucket per step, on each rank, after the priming step
    assert len(ring_calls) >= 2 * 2 * 4, len(ring_calls)
