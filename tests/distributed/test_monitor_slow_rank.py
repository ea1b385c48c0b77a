"""A deliberately slowed rank is named the slowest, in every aggregation and in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torsh_distributed.monitor.step import SLOW_RANK_ENV
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train


def _config(**monitor) -> dict:
    cfg = preset("tiny")
    cfg.max_steps = 24
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 300_000
    for key, value in monitor.items():
        setattr(cfg.monitor, key, value)
    return cfg.to_dict()


def _train(config: dict) -> dict:
    return train(TrainConfig.from_dict(config)).monitor


@pytest.mark.slow
def test_slowed_rank_is_named_in_aggregates_and_report(tmp_path: Path):
    out = tmp_path / "report.json"
    trace = tmp_path / "phases.json"
    reports = run_distributed(
        _train, 2, args=(_config(every=4, report_json=str(out), trace=str(trace)),), timeout=240,
        env={SLOW_RANK_ENV: "1:0.08"},
    )
    written = json.loads(out.read_text())
    assert written["slowest_rank"] == 1, written["per_rank"]
    assert [rank for _step, rank in written["slowest_by_step"]] == [1] * 6
    assert [step for step, _rank in written["slowest_by_step"]] == [4, 8, 12, 16, 20, 24]
    imbalance = [f for f in written["findings"] if f["kind"] == "imbalance"]
    assert imbalance and imbalance[0]["message"].startswith("rank 1 is the slowest")
    # rank 1 sleeps 80 ms in "data"; rank 0 spends that time waiting on communication
    ranks = written["per_rank"]
    assert ranks[1]["data"] > 0.07 and ranks[0]["comm_wait"] > ranks[1]["comm_wait"] + 0.04
    # Every rank built the same report (only rank 0 evaluates alerts; each times itself).
    own = ("alerts", "monitor_overhead")
    assert {k: v for k, v in reports[1].items() if k not in own} == {
        k: v for k, v in reports[0].items() if k not in own
    }
    assert 0 < reports[1]["monitor_overhead"]["share_of_step_time"] < 0.05
    assert reports[1]["monitor_overhead"]["aggregations"] == 6


    # The merged trace: both ranks, and rank 0 waits (comm_wait) while rank 1 sleeps in data.
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    spans: dict[tuple[int, int, str], list[tuple[float, float]]] = {}
    for e in events:
        spans.setdefault((e["pid"], e["args"]["step"], e["name"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert {pid for pid, _, _ in spans} == {0, 1} and {s for _, s, _ in spans} == set(range(1, 25))
    overlapping = 0
    for step in range(2, 25):
        (data,) = spans[(1, step, "data")]
        assert data[1] - data[0] >= 80_000  # microseconds
        waits = spans[(0, step, "comm_wait")]  # DDP's all-reduce tail and the loss all-reduce
        overlapping += any(min(w[1], data[1]) - max(w[0], data[0]) > 40_000 for w in waits)
    assert overlapping >= 20, f"rank 0's waits line up with rank 1's sleeps in only {overlapping}/23 steps"
