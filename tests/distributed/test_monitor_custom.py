"""StepMonitor on 2 ranks in a user's own loop: custom metrics gathered across ranks, a report at
the end, and a mismatch of declared names failing on every rank instead of hanging."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torsh_distributed.monitor import JsonlSink, MonitorConfig, StepMonitor
from torsh_distributed.testing import RankFailedError, run_distributed


class _CountingSink:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def update(self, agg: Any, *, alerts_by_severity: dict[str, int], anomalies: list[Any]) -> None:
        self.steps.append(agg.step)

    def close(self) -> None:
        pass


def _log_per_rank(path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    mon = StepMonitor(MonitorConfig(enabled=True, every=2), custom_metrics=("accuracy", "only_rank1"),
                      sinks=[JsonlSink(path)], echo=lambda _text: None)
    for step in range(4):
        mon.step_begin(step)
        mon.phase("data")
        mon.log("accuracy", 10.0 * rank + step)  # window 2: rank 0 logs 2, 3; rank 1 logs 12, 13
        if rank == 1:
            mon.log("only_rank1", 5.0)
        mon.step_end(step + 1, loss=1.0, lr=0.1)
    assert mon.latest is not None
    flat = mon.latest.flat()
    report = mon.finish()
    return {"rank": mon.rank, "world_size": mon.world_size,
            "flat": {k: v for k, v in flat.items() if k.startswith("custom.")}, "custom": report["custom"]}


def test_custom_metrics_are_gathered_across_ranks(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    results = run_distributed(_log_per_rank, 2, args=(str(path),), timeout=120)
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]  # from the group
    flat = results[0]["flat"]
    assert flat["custom.accuracy_mean"] == pytest.approx((2.5 + 12.5) / 2)
    assert flat["custom.accuracy_min"] == pytest.approx(2.5) and flat["custom.accuracy_max"] == pytest.approx(12.5)
    # a name only rank 1 logs: rank 0's NaN is left out, not averaged in as 0
    assert flat["custom.only_rank1_mean"] == flat["custom.only_rank1_min"] == 5.0
    assert results[1]["flat"] == flat  # every rank holds the whole matrix
    assert results[0]["custom"]["accuracy"] == pytest.approx(
        {"last": 7.5, "mean": (5.5 + 7.5) / 2, "min": 0.5, "max": 12.5}  # windows: 0.5 | 10.5, 2.5 | 12.5
    )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4]  # rank 0 alone writes, once per aggregation
    assert lines[1]["custom.accuracy_max"] == pytest.approx(12.5)


def _user_loop() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = _CountingSink()
    mon = StepMonitor(MonitorConfig(enabled=True, every=2), params=list(model.parameters()),
                      samples_per_step=16, custom_metrics=("local_loss",), sinks=[sink],
                      echo=lambda _text: None)
    generator = torch.Generator().manual_seed(rank)
    for step in range(5):
        mon.step_begin(step)
        x = torch.randn(16, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        mon.phase("data")
        loss = nn.functional.mse_loss(model(x), y)
        mon.phase("forward")
        optimizer.zero_grad()
        loss.backward()
        mon.phase("backward")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        mon.phase("optimizer")
        mon.log("local_loss", loss.detach())  # a tensor: converted at the aggregation
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        mon.step_end(step + 1, loss=float(global_loss) / 2, lr=0.05, grad_norm=grad_norm)
    report = mon.finish()
    return {"report": report, "sink_steps": sink.steps}


def test_a_user_loop_gets_a_report():
    results = run_distributed(_user_loop, 2, timeout=120)
    report = results[0]["report"]
    assert report["steps"] == 5 and report["world_size"] == 2
    assert [p["rank"] for p in report["per_rank"]] == [0, 1]
    assert report["breakdown"]["step_time"] > 0 and report["breakdown"]["forward"] > 0
    assert report["slowest_by_step"][-1][0] == 5 and report["tokens_per_s"] == 0.0
    local = report["custom"]["local_loss"]
    assert 0 < local["min"] <= local["last"] <= local["max"]
    assert results[0]["sink_steps"] == [2, 4, 5] and results[1]["sink_steps"] == []  # rank 0 only
    assert results[1]["report"]["custom"] == report["custom"]


def _mismatched_names() -> None:
    names = ("accuracy",) if dist.get_rank() == 0 else ("accuracy", "recall")
    mon = StepMonitor(MonitorConfig(enabled=True, every=1), custom_metrics=names)
    mon.step_begin(0)
    mon.step_end(1, loss=1.0, lr=0.1)  # first aggregation: raises on every rank, no hang


def test_ranks_declaring_different_names_fail_fast():
    with pytest.raises(RankFailedError, match=r"custom_metrics differ across ranks: ranks \[1\]"):
        run_distributed(_mismatched_names, 2, timeout=120)
