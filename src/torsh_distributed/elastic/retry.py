"""Retry with exponential backoff (on tenacity), and a circuit breaker, for store and network
operations.

:class:`Backoff` says how long to wait before attempt ``n`` (exponential, capped, with jitter so that
many ranks retrying a store do not hammer it in lock-step). :func:`retry` runs a call until it
succeeds, the attempts or the deadline run out, or it raises an error that is not transient; the
loop itself is tenacity's ``Retrying`` (stop, wait, exception filter, sleep), with
:meth:`Backoff.delay` as its wait: tenacity's jitter is additive (``wait_random``) or full
(``wait_random_exponential``), not the relative spread documented here.
:class:`CircuitBreaker` stops calling an operation that keeps failing: after ``failure_threshold``
consecutive failures it *opens* and fails fast with :class:`CircuitOpenError` for
``reset_timeout_s``, then lets one trial call through (*half-open*); success closes it again.
tenacity has no circuit breaker; ours is kept (about 60 lines) for its injectable clock and its
error in the package's hierarchy, rather than adding pybreaker for it.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity
import torch.distributed as dist

from torsh_distributed.runtime.errors import CommunicationError, DistributedTimeoutError

__all__ = ["Backoff", "retry", "CircuitBreaker", "CircuitOpenError", "TRANSIENT"]

T = TypeVar("T")

TRANSIENT: tuple[type[BaseException], ...] = (
    ConnectionError,  # refused, reset, aborted, broken pipe
    TimeoutError,  # socket timeouts
    socket.gaierror,  # name resolution, often not ready yet while a cluster starts
    dist.DistNetworkError,  # torch's stores: connection refused/reset, socket timeout
    dist.DistStoreError,  # torch's stores: a wait or get that timed out
)
"""Exceptions :func:`retry` treats as transient by default: network and store failures only.
Not every ``OSError`` (a missing file does not come back) nor every ``RuntimeError`` (torch's
usage errors are RuntimeErrors); pass ``retry_on=(*TRANSIENT, ...)`` to widen it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Backoff:
    """Exponential backoff: ``initial_s * multiplier**n``, at most ``max_s``, +/- ``jitter``."""

    initial_s: float = 0.05
    """Delay before the second attempt."""
    multiplier: float = 2.0
    """Growth per attempt (>= 1)."""
    max_s: float = 5.0
    """Cap of one delay."""
    jitter: float = 0.1
    """Relative random spread of each delay, in [0, 1)."""
    max_attempts: int = 5
    """Attempts in all (1 = no retry)."""

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError(f"need 0 <= initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")

    def delay(self, attempt: int, *, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based)."""
        base = min(self.initial_s * self.multiplier**attempt, self.max_s)
        spread = (rng or random).uniform(-self.jitter, self.jitter) if self.jitter else 0.0
        return max(0.0, base * (1.0 + spread))


class CircuitOpenError(CommunicationError):
    """The circuit breaker is open: the operation failed too often and is not tried now."""


class CircuitBreaker:
    """Fail fast after repeated failures; probe again after a cool-down.

    Args:
        failure_threshold: Consecutive failures that open the circuit.
        reset_timeout_s: Seconds the circuit stays open before one trial call is allowed.
        name: Names the protected operation in errors.
        clock: Time source (tests pass a fake one).
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        reset_timeout_s: float = 10.0,
        name: str = "operation",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or reset_timeout_s < 0:
            raise ValueError("failure_threshold must be >= 1 and reset_timeout_s >= 0")
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None

    @property
    def state(self) -> str:
        """``closed`` (calls pass), ``open`` (calls fail fast) or ``half-open`` (one trial)."""
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.reset_timeout_s:
            return "half-open"
        return "open"

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` through the breaker; :class:`CircuitOpenError` while open."""
        with self._lock:
            if self._state() == "open":
                left = self.reset_timeout_s - (self._clock() - self._opened_at)  # type: ignore[operator]
                raise CircuitOpenError(
                    f"{self.name} failed {self._failures} times in a row; not retried for "
                    f"another {left:.1f} s",
                    operation=self.name,
                    fix="check that the store/server is up and reachable",
                )
        try:
            result = fn()
        except BaseException:
            with self._lock:
                self._failures += 1
                if self._failures >= self.failure_threshold or self._opened_at is not None:
                    self._opened_at = self._clock()  # open, or re-open after a failed trial
            raise
        with self._lock:
            self._failures = 0
            self._opened_at = None
        return result


def retry(
    fn: Callable[[], T],
    *,
    backoff: Backoff | None = None,
    retry_on: tuple[type[BaseException], ...] = TRANSIENT,
    deadline_s: float | None = None,
    breaker: CircuitBreaker | None = None,
    operation: str = "operation",
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn`` until it succeeds, retrying transient failures with exponential backoff.

    Args:
        fn: The operation (no arguments; use a lambda).
        backoff: Delays and attempt count; default :class:`Backoff`.
        retry_on: Exception types worth retrying; others propagate at once, unchanged. Wider
            types retry mistakes too (each costs the whole backoff before the error shows).
        deadline_s: Give up when the next attempt would start this many seconds or more after
            the first (tenacity's ``stop_before_delay``).
        breaker: Route calls through this circuit breaker; an open circuit is not retried.
        operation: Names the operation in the final error.
        sleep: Sleep function (tests pass a fake one).

    Raises:
        DistributedTimeoutError: every attempt failed (the last error is chained).
        CircuitOpenError: the breaker is open.
    """
    policy = backoff or Backoff()
    stop = tenacity.stop_after_attempt(policy.max_attempts)
    if deadline_s is not None:
        stop = stop | tenacity.stop_before_delay(deadline_s)
    retrying = tenacity.Retrying(
        stop=stop,
        wait=lambda state: policy.delay(state.attempt_number - 1),
        retry=tenacity.retry_if_exception_type(retry_on)
        & tenacity.retry_if_not_exception_type(CircuitOpenError),
        sleep=sleep,
    )
    call: Callable[[], T] = fn if breaker is None else (lambda: breaker.call(fn))
    started = time.monotonic()
    try:
        return retrying(call)
    except tenacity.RetryError as err:
        attempts = err.last_attempt.attempt_number
        last = err.last_attempt.exception()
    raise DistributedTimeoutError(
        f"{operation} failed after {attempts} attempt(s) in {time.monotonic() - started:.2f} s: "
        f"{type(last).__name__}: {last}",
        operation=operation,
        fix="check that the store/server is reachable; raise the attempts or the deadline",
    ) from last
