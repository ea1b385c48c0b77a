"""retry on tenacity: which errors are transient, the deadline, an open circuit is final."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from torsh_distributed.elastic.retry import Backoff, CircuitBreaker, CircuitOpenError, retry
from torsh_distributed.runtime.errors import DistributedTimeoutError

NO_WAIT = Backoff(initial_s=0.0, jitter=0.0, max_attempts=3)


def _failing(exc: BaseException, calls: list[int]):
    def fn() -> None:
        calls.append(1)
        raise exc

    return fn


@pytest.mark.parametrize(
    "exc",
    [
        dist.DistNetworkError("Connection reset by peer"),
        dist.DistStoreError("wait timeout after 30000ms"),
        TimeoutError("timed out"),
    ],
    ids=["store-network", "store-timeout", "timeout"],
)
def test_store_and_network_failures_are_retried(exc):
    calls: list[int] = []
    with pytest.raises(DistributedTimeoutError, match="failed after 3 attempt") as info:
        retry(_failing(exc, calls), backoff=NO_WAIT, sleep=lambda s: None)
    assert len(calls) == 3 and info.value.__cause__ is exc


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied"),  # a bug, not a blip
        FileNotFoundError("no such file"),  # an OSError that does not come back
        NotImplementedError("not here"),
    ],
    ids=["runtime", "missing-file", "not-implemented"],
)
def test_other_errors_propagate_unchanged_after_one_call(exc):
    calls: list[int] = []
    with pytest.raises(type(exc)) as info:
        retry(_failing(exc, calls), backoff=NO_WAIT, sleep=lambda s: None)
    assert info.value is exc and len(calls) == 1


def test_the_deadline_stops_before_a_sleep_that_would_cross_it():
    sleeps: list[float] = []
    policy = Backoff(initial_s=1.0, jitter=0.0, max_attempts=10)
    with pytest.raises(DistributedTimeoutError, match="store.get failed after 3 attempt"):
        retry(
            _failing(ConnectionRefusedError("refused"), []),
            backoff=policy,
            deadline_s=2.5,
            operation="store.get",
            sleep=sleeps.append,  # no time passes: the upcoming 4 s sleep alone crosses 2.5 s
        )
    assert sleeps == [1.0, 2.0]


def test_an_open_circuit_is_not_retried_even_when_every_error_is():
    breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=60, name="store.set")
    calls: list[int] = []
    fn = _failing(ConnectionError("down"), calls)
    with pytest.raises(CircuitOpenError, match="store.set failed 1 times in a row"):
        retry(fn, backoff=NO_WAIT, retry_on=(Exception,), breaker=breaker, sleep=lambda s: None)
    assert len(calls) == 1  # the first failure opened it; the retry met the open circuit
