"""Aggregation across ranks, window statistics, and the z-score anomaly detector."""

from __future__ import annotations

import math

import pytest
import torch

from torsh_distributed.monitor import FIELDS, PHASES, ZScoreDetector, aggregate, gather
from torsh_distributed.monitor.anomaly import AnomalyTracker
from torsh_distributed.monitor.metrics import WindowStats, rss_bytes


def _row(**values: float) -> list[float]:
    base = dict.fromkeys(FIELDS, 0.0)
    base.update(step=10.0, step_time=0.1, loss=2.0, lr=1e-3, grad_norm=1.0)
    base.update(values)
    return [base[f] for f in FIELDS]


def test_aggregate_min_median_max_and_slowest_rank_by_busy_time():
    # Equal step time everywhere (DDP makes fast ranks wait); rank 2 waits least = busiest.
    rows = [
        _row(step_time=0.10, comm_wait=0.04, tokens_per_s=1000),
        _row(step_time=0.10, comm_wait=0.05, tokens_per_s=1000),
        _row(step_time=0.10, comm_wait=0.00, tokens_per_s=1000),
        _row(step_time=0.10, comm_wait=0.04, tokens_per_s=1000),
    ]
    agg = aggregate(torch.tensor(rows, dtype=torch.float64))
    assert agg.slowest_rank == 2
    assert agg.busy == pytest.approx([0.06, 0.05, 0.10, 0.06])
    assert agg.imbalance == pytest.approx(0.10 / 0.06)
    assert agg.stat("comm_wait") == pytest.approx({"min": 0.0, "median": 0.04, "max": 0.05})
    assert agg.tokens_per_s == pytest.approx(4000)
    flat = agg.flat()
    assert flat["slowest_rank"] == 2.0 and flat["step_time_max"] == pytest.approx(0.10)
    assert flat["comm_share"] == pytest.approx(0.4) and flat["loss"] == pytest.approx(2.0)


def test_aggregate_ignores_nan_in_statistics_and_rejects_bad_shapes():
    agg = aggregate([_row(grad_norm=math.nan), _row(grad_norm=3.0)])
    assert agg.stat("grad_norm") == {"min": 3.0, "median": 3.0, "max": 3.0}
    with pytest.raises(ValueError, match=r"expected rows of \d+ fields"):
        aggregate([[1.0, 2.0]])
    with pytest.raises(ValueError, match="expected rows"):
        aggregate([])


def test_window_row_is_means_per_step_and_rates_over_step_time():
    w = WindowStats()
    for _ in range(4):
        w.add_step(0.5, dict(zip(PHASES, (0.1, 0.1, 0.2, 0.05, 0.05), strict=True)), samples=8, tokens=512)
    row = dict(zip(FIELDS, w.row(step=4, rss=1e6, cuda=0.0), strict=True))
    assert row["step_time"] == pytest.approx(0.5) and row["backward"] == pytest.approx(0.2)
    assert row["samples_per_s"] == pytest.approx(16.0) and row["tokens_per_s"] == pytest.approx(1024.0)
    assert row["step"] == 4 and row["rss_bytes"] == 1e6


def test_gather_without_process_group_is_this_rank_alone():
    agg = gather(_row(step=7.0))
    assert agg.step == 7 and len(agg.ranks) == 1 and agg.slowest_rank == 0 and agg.imbalance == 1.0


def test_rss_is_positive():
    assert rss_bytes() > 1e6


def test_zscore_flags_a_spike_but_not_noise():
    det = ZScoreDetector(window=20, threshold=3.0, min_samples=5)
    noise = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98, 1.1, 0.92, 1.0]
    assert all(det.update(v, metric="step_time", step=i) is None for i, v in enumerate(noise))
    spike = det.update(2.0, metric="step_time", step=11)
    assert spike is not None and spike.z > 3.0 and spike.metric == "step_time" and spike.step == 11
    assert "step_time = 2 at step 11" in spike.describe()
    # The spike stayed out of the window: a second spike is flagged too.
    assert det.update(2.0, step=12) is not None


def test_zscore_needs_min_samples_and_tolerates_flat_series():
    det = ZScoreDetector(window=10, threshold=3.0, min_samples=4)
    assert det.update(1.0) is None and det.update(100.0) is None  # too few values yet
    flat = ZScoreDetector(window=10, threshold=3.0, min_samples=3)
    for _ in range(5):
        assert flat.update(5.0) is None
    assert flat.update(5.01) is None  # within rel_floor of a zero-variance baseline
    assert flat.update(6.0) is not None  # outside: infinite z
    assert ZScoreDetector().update(math.nan) is not None  # NaN loss is always anomalous


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"window": 2}, "window must be >= 3"), ({"threshold": 0}, "threshold must be > 0"),
     ({"window": 5, "min_samples": 6}, r"min_samples must be in \[2, window=5\]")],
)
def test_zscore_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZScoreDetector(**kwargs)


def test_tracker_keeps_anomalies_per_metric():
    tracker = AnomalyTracker(("loss",), window=10, threshold=3.0)
    for step in range(10):
        assert tracker.update({"loss": 2.0 + 0.01 * (step % 3), "other": 1e9}, step=step) == []
    found = tracker.update({"loss": 9.0}, step=10)
    assert [a.metric for a in found] == ["loss"] and list(tracker.found) == found


def test_phase_trace_single_process_writes_chrome_events(tmp_path):
    import json

    from torsh_distributed.monitor.trace import PhaseTrace

    trace = PhaseTrace()
    trace.add(1, "data", 10.0, 10.002)
    trace.add(1, "forward", 10.002, 10.005)
    trace.add(1, "comm_wait", 10.005, 10.005)  # empty spans are dropped
    path = trace.write_merged(tmp_path / "t.json")
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["args"]["step"]) for e in events] == [("data", 0, 1), ("forward", 0, 1)]
    assert events[0]["dur"] == pytest.approx(2000.0) and events[1]["ts"] - events[0]["ts"] == pytest.approx(2000.0)
