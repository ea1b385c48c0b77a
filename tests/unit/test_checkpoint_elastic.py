"""Retry/backoff, circuit breaker, heartbeats and health, straggler report, ElasticState (one process)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.checkpoint import CheckpointManager
from torsh_distributed.elastic.health import (
    DEGRADED,
    FAILED,
    HEALTHY,
    HealthMonitor,
    Heartbeat,
    straggler_report,
)
from torsh_distributed.elastic.retry import Backoff, CircuitBreaker, CircuitOpenError, retry
from torsh_distributed.elastic.state import ElasticState, run
from torsh_distributed.runtime.errors import CheckpointError, DistributedTimeoutError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_grows_exponentially_and_is_capped():
    policy = Backoff(initial_s=0.1, multiplier=2, max_s=0.5, jitter=0.0, max_attempts=6)
    assert [policy.delay(i) for i in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    jittered = Backoff(initial_s=1.0, jitter=0.5).delay(0, rng=random.Random(1))
    assert 0.5 <= jittered <= 1.5
    with pytest.raises(ValueError, match="multiplier must be >= 1"):
        Backoff(multiplier=0.5)


def test_retry_recovers_from_transient_failures():
    calls, sleeps = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    policy = Backoff(initial_s=0.01, jitter=0.0, max_attempts=5)
    assert retry(flaky, backoff=policy, sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and sleeps == [0.01, 0.02]


def test_retry_gives_up_with_the_last_error_and_does_not_retry_user_errors():
    policy = Backoff(initial_s=0.0, jitter=0.0, max_attempts=3)

    def down() -> None:
        raise ConnectionRefusedError("refused")

    with pytest.raises(DistributedTimeoutError, match="store.get failed after 3 attempt.*refused"):
        retry(down, backoff=policy, operation="store.get", sleep=lambda s: None)
    calls = []

    def bad() -> None:
        calls.append(1)
        raise KeyError("no such key")

    with pytest.raises(KeyError):
        retry(bad, backoff=policy, sleep=lambda s: None)
    assert len(calls) == 1


def test_circuit_breaker_opens_fails_fast_and_closes_after_a_good_trial():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, reset_timeout_s=10, name="store.set", clock=clock)
    calls = []

    def down() -> None:
        calls.append(1)
        raise ConnectionError("down")

    for _ in range(2):
        with pytest.raises(ConnectionError):
            breaker.call(down)
    assert breaker.state == "open"
    with pytest.raises(CircuitOpenError, match="store.set failed 2 times in a row"):
        breaker.call(down)
    assert len(calls) == 2, "an open circuit must not call the operation"
    clock.now = 10.0
    assert breaker.state == "half-open"
    with pytest.raises(ConnectionError):
        breaker.call(down)  # failed trial: open again
    assert breaker.state == "open"
    clock.now = 20.0
    assert breaker.call(lambda: 42) == 42 and breaker.state == "closed"


def test_health_healthy_degraded_failed_with_reasons():
    store = dist.HashStore()
    clock = FakeClock()
    monitor = HealthMonitor(store, 3, interval_s=1.0, clock=clock)
    beats = [Heartbeat(store, rank, interval_s=1.0) for rank in range(3)]
    for rank, beat in enumerate(beats[:2]):
        beat.update(step=5, step_time_s=0.1 if rank == 0 else 0.1)
        beat.beat()
    states = {h.rank: h for h in monitor.poll()}
    assert states[0].state == HEALTHY and states[1].state == HEALTHY
    assert states[2].state == HEALTHY  # not yet overdue
    clock.now = 4.0
    beats[0].beat()
    states = {h.rank: h for h in monitor.poll()}
    assert states[0].state == HEALTHY
    assert states[1].state == DEGRADED and "silent for 4.0 s" in states[1].reason
    clock.now = 12.0
    beats[0].update(step=6, step_time_s=0.1)
    beats[0].beat()
    states = {h.rank: h for h in monitor.poll()}
    assert states[1].state == FAILED and "no heartbeat for 12.0 s" in states[1].reason
    assert states[2].state == FAILED and "never sent a heartbeat" in states[2].reason
    assert states[0].step == 6


def test_health_names_a_slow_rank_from_reported_step_times():
    store = dist.HashStore()
    monitor = HealthMonitor(store, 3, interval_s=1.0, clock=FakeClock())
    for rank, step_time in enumerate([0.1, 0.1, 0.5]):
        beat = Heartbeat(store, rank)
        beat.update(step=3, step_time_s=step_time)
        beat.beat()
    states = {h.rank: h for h in monitor.poll()}
    assert (
        states[2].state == DEGRADED and "straggler: step time 0.500 s is 5.0x" in states[2].reason
    )
    assert states[0].state == HEALTHY


def test_straggler_report_names_the_slowest_ranks_and_their_cost():
    times = [[0.10, 0.11, 0.10], [0.10, 0.10, 0.12], [0.30, 0.31, 0.29], [0.15, 0.16, 0.15]]
    report = straggler_report(times, k=2)
    assert [r.rank for r in report.slowest] == [2, 3]
    rank2 = report.ranks[2]
    assert (rank2.min_s, rank2.median_s, rank2.max_s) == (0.29, 0.30, 0.31)
    assert rank2.cost_s == pytest.approx((0.30 - 0.125) + (0.31 - 0.135) + (0.29 - 0.135))
    assert "slowest over 3 steps: rank 2" in report.format()
    with pytest.raises(ValueError, match="same number of steps"):
        straggler_report([[0.1], [0.1, 0.2]])
    with pytest.raises(ValueError, match="k must be in"):
        straggler_report(times, k=5)


def test_elastic_state_commit_restore_and_durable_resume(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ElasticState(model=model, optimizer=optim, manager=CheckpointManager(tmp_path), epoch=0)
    with pytest.raises(CheckpointError, match="restore\\(\\) before any commit"):
        state.restore()
    state.epoch = 3
    state.commit(step=3)
    state.manager.wait()
    committed = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    state.epoch = 4
    state.restore()
    assert state.epoch == 3 and torch.equal(model.weight, committed)
    with pytest.raises(AttributeError, match="no value 'nope'"):
        _ = state.nope

    fresh = torch.nn.Linear(4, 2)
    again = ElasticState(
        model=fresh,
        optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1),
        manager=CheckpointManager(tmp_path),
        epoch=0,
    )

    @run
    def body(s: ElasticState) -> int:
        return s.epoch

    assert body(again) == 3 and torch.equal(fresh.weight, committed)
