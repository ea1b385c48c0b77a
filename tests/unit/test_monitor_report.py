"""Bottleneck report rules: communication, memory, data wait, imbalance (slowest rank), anomalies."""

from __future__ import annotations

import json

import pytest

from torsh_distributed.monitor import FIELDS, aggregate, build_report
from torsh_distributed.monitor.anomaly import Anomaly

GiB = float(2**30)


def _agg(step: int, ranks: list[dict[str, float]]):
    rows = []
    for values in ranks:
        base = dict.fromkeys(FIELDS, 0.0)
        base.update(step=step, step_time=0.1, forward=0.03, backward=0.04, optimizer=0.01,
                    data=0.005, comm_wait=0.015, rss_bytes=1 * GiB, tokens_per_s=1000, loss=2.0)
        base.update(values)
        rows.append([base[f] for f in FIELDS])
    return aggregate(rows)


def _history(ranks_values: list[dict[str, float]], n: int = 4):
    return [_agg(10 * (i + 1), ranks_values) for i in range(n)]


def _kinds(report) -> list[str]:
    return [f.kind for f in report.findings]


def test_balanced_run_has_no_findings_and_formats():
    report = build_report(_history([{}, {}]), memory_limit=64 * GiB, local_world_size=2)
    assert _kinds(report) == []
    assert report.breakdown["step_time"] == pytest.approx(0.1)
    text = report.format()
    assert "no bottleneck found" in text and "comm_wait 15.0 ms (15%)" in text
    json.dumps(report.to_dict(), allow_nan=False)


def test_communication_share_above_30_percent_recommends_compression_buckets_hierarchical():
    report = build_report(_history([{"comm_wait": 0.04, "backward": 0.015}] * 2), memory_limit=64 * GiB)
    (finding,) = report.findings
    assert finding.kind == "communication" and "40% of the step waits on communication" in finding.message
    assert "slowest rank 0" in finding.message
    recs = " ".join(finding.recommendations)
    assert "--compression" in recs and "--bucket-cap-mb" in recs and "--comm-algorithm hierarchical" in recs


def test_memory_near_limit_recommends_zero_checkpointing_offload():
    # Two local ranks of 3.5 GiB each on an 8 GiB machine: 88 %.
    report = build_report(_history([{"rss_bytes": 3.5 * GiB}] * 2), memory_limit=8 * GiB,
                          local_world_size=2)
    (finding,) = report.findings
    assert finding.kind == "memory" and finding.severity == "warning"
    assert "memory use 88% of the limit" in finding.message
    recs = " ".join(finding.recommendations)
    assert "--zero-stage" in recs and "--activation-checkpointing" in recs and "offload" in recs
    gpu = build_report(_history([{"cuda_bytes": 79 * GiB}]), memory_limit=512 * GiB, cuda_limit=80 * GiB)
    assert _kinds(gpu) == ["memory"] and gpu.findings[0].severity == "critical"
    assert "of GPU memory" in gpu.findings[0].message


def test_data_wait_recommends_more_loader_workers():
    report = build_report(_history([{"data": 0.03, "forward": 0.005}] * 2), memory_limit=64 * GiB)
    assert _kinds(report) == ["data"]
    assert "rank 0 spends 30% of the step waiting on data" in report.findings[0].message
    assert any("workers" in r for r in report.findings[0].recommendations)


def test_slowed_rank_is_named_slowest():
    # Rank 1 sleeps in data; rank 0 waits for it in communication; step times are equal.
    ranks = [{"comm_wait": 0.06, "data": 0.001}, {"comm_wait": 0.01, "data": 0.05}, {"comm_wait": 0.06}]
    report = build_report(_history(ranks), memory_limit=64 * GiB)
    assert report.slowest_rank == 1
    imbalance = [f for f in report.findings if f.kind == "imbalance"]
    assert imbalance and imbalance[0].message.startswith("rank 1 is the slowest")
    # The others wait 60 ms for it, but rank 1's own wait is small: not a communication problem.
    assert "communication" not in _kinds(report)
    assert "rank 1 spends 50% of the step waiting on data" in report.findings[0].message
    assert report.per_rank[1]["busy"] == pytest.approx(0.09)


def test_first_aggregation_is_skipped_as_warm_up_and_anomalies_listed():
    history = [_agg(10, [{"comm_wait": 0.09}])] + _history([{}], n=3)
    anomaly = Anomaly("loss", 30, 9.0, 2.0, 0.1, 70.0)
    report = build_report(history, memory_limit=64 * GiB, anomalies=[anomaly], alerts={"opened": 1})
    assert _kinds(report) == ["anomaly"] and "loss = 9 at step 30" in report.findings[0].message
    assert report.to_dict()["alerts"] == {"opened": 1} and report.steps == 30
    with pytest.raises(ValueError, match="at least one aggregation"):
        build_report([], memory_limit=1.0)


def test_profiled_collective_time_counts_as_communication():
    # A blocking comm hook: little exposed wait, but 50 % of the step inside collectives.
    report = build_report(_history([{"comm_time": 0.05}] * 2), memory_limit=64 * GiB)
    assert _kinds(report) == ["communication"] and "50% of the step" in report.findings[0].message
