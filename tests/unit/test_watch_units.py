"""HealthWatch on one process: heartbeats of three "ranks" through a real store, rank 0's checks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from torsh_distributed.elastic.watch import HealthWatch


def _watches(store: dist.Store, **kwargs) -> list[HealthWatch]:
    return [
        HealthWatch(store, rank=r, world_size=3, info={"node": r // 2, "host": f"h{r // 2}"},
                    echo=lambda _: None, **kwargs)
        for r in range(3)
    ]


def test_silent_rank_is_named_then_recovers_and_done_ranks_are_not_failures() -> None:
    store = dist.HashStore()
    now = [0.0]
    watches = _watches(store, interval_s=1.0, failed_after_intervals=3)
    monitor = watches[0].monitor
    assert monitor is not None and watches[1].monitor is None
    monitor._clock = lambda: now[0]  # the monitor's own clock decides silence
    monitor._started = 0.0
    for w in watches:
        w.heartbeat.beat()
    assert watches[0].check() == []
    now[0] = 3.5  # ranks 0 and 1 beat again, rank 2 stays silent
    watches[0].heartbeat.beat()
    watches[1].heartbeat.beat()
    lines = watches[0].check()
    assert lines == [
        "health: rank 2 (node 1, host h1) FAILED: no heartbeat for 3.5 s (failed after 3 s)"
    ]
    assert watches[0].check() == []  # reported once per change
    now[0] = 4.0
    watches[2].heartbeat.beat()
    assert watches[0].check() == ["health: rank 2 (node 1, host h1) healthy again"]
    watches[1].heartbeat.stop(done=True)  # finished: its silence is not a failure
    now[0] = 20.0
    for w in (watches[0], watches[2]):
        w.heartbeat.beat()
    assert watches[0].check() == []


def test_straggler_by_busy_time() -> None:
    store = dist.HashStore()
    clock = [0.0]
    watches = _watches(store, interval_s=1.0, clock=lambda: clock[0])
    for w in watches:
        w.step_end(1, comm_wait_s=0.0)
    clock[0] = 1.0  # one more iteration of 1 s: ranks 0, 1 waited 0.8 s for rank 2
    for rank, w in enumerate(watches):
        w.step_end(2, comm_wait_s=0.0 if rank == 2 else 0.8)
        w.heartbeat.beat()
    lines = watches[0].check()
    assert len(lines) == 1 and lines[0].startswith("health: rank 2 (node 1, host h1) degraded: straggler")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        HealthWatch(dist.HashStore(), rank=0, world_size=2, interval_s=0)
    with pytest.raises(ValueError, match="failed_after_intervals"):
        HealthWatch(dist.HashStore(), rank=0, world_size=2, failed_after_intervals=0.5)
