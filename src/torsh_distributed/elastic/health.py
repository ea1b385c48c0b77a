"""Failure and straggler detection: heartbeats through the store, per-rank health, step-time report.

Heartbeats. Every rank runs a :class:`Heartbeat` that writes ``{seq, step, step_time_s}`` to the
key ``torsh/hb/RANK`` of a store (the job's TCP store, a Redis store, ...) every ``interval_s``.
A :class:`HealthMonitor` (usually on rank 0, or outside the job) reads the keys and classifies
every rank as ``healthy``, ``degraded`` or ``failed`` with the reason. It notes *its own* clock when
a rank's ``seq`` last changed, so clocks of different hosts never need to agree.

Stragglers. In synchronous data parallelism a fast rank waits for the slowest inside the
collective, so whole-step times look alike on every rank; feed :func:`straggler_report` the time
each rank spent *before* the synchronising collective (its compute time). It returns per-rank
min/median/max, the ``k`` slowest ranks and the time they cost: for each step, how much longer
the rank took than the median rank, summed over the steps.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torsh_distributed.elastic.retry import Backoff, CircuitBreaker, retry

__all__ = [
    "HEALTHY",
    "DEGRADED",
    "FAILED",
    "RankHealth",
    "Heartbeat",
    "HealthMonitor",
    "RankStepStats",
    "StragglerReport",
    "straggler_report",
    "gather_step_times",
]

HEALTHY, DEGRADED, FAILED = "healthy", "degraded", "failed"
_PREFIX = "torsh/hb"
_STORE_BACKOFF = Backoff(initial_s=0.05, max_s=1.0, max_attempts=4)


@dataclass(frozen=True, slots=True)
class RankHealth:
    """Health of one rank as seen by a :class:`HealthMonitor`."""

    rank: int
    """Global rank."""
    state: str
    """``healthy``, ``degraded`` or ``failed``."""
    reason: str
    """Why it is not healthy (empty when healthy)."""
    silent_s: float
    """Seconds since its heartbeat last changed (since the monitor started if never seen)."""
    step: int | None
    """Last step it reported."""
    step_time_s: float | None
    """Last step time it reported."""
    info: dict = field(default_factory=dict)
    """What the rank said about itself in its heartbeats (``Heartbeat(info=...)``: node, host),
    plus ``"done": True`` once it stopped beating on purpose."""


class Heartbeat:
    """Publish this rank's liveness and progress to ``store`` from a background thread.

    Args:
        store: A ``torch.distributed.Store`` every rank and the monitor can reach.
        rank: This rank.
        interval_s: Seconds between beats; the monitor's thresholds are multiples of it.
        prefix: Key prefix (one per job if a store is shared).
        info: Small JSON-able facts sent with every beat (``{"node": 1, "host": "gpu07"}``), so
            the monitor can name where a rank runs.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        *,
        interval_s: float = 1.0,
        prefix: str = _PREFIX,
        info: dict | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.store, self.rank, self.interval_s, self.prefix = store, rank, interval_s, prefix
        self.info = dict(info or {})
        self._done = False
        self._seq = 0
        self._step: int | None = None
        self._step_time: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._breaker = CircuitBreaker(
            failure_threshold=5, reset_timeout_s=5 * interval_s, name=f"heartbeat of rank {rank}"
        )

    def update(self, step: int, step_time_s: float | None = None) -> None:
        """Record progress; sent with the next beat."""
        self._step, self._step_time = step, step_time_s

    def beat(self) -> None:
        """Send one heartbeat now (retried with backoff, behind a circuit breaker)."""
        self._seq += 1
        payload = json.dumps(
            {
                "seq": self._seq,
                "step": self._step,
                "step_time_s": self._step_time,
                "info": {**self.info, **({"done": True} if self._done else {})},
            }
        )
        key = f"{self.prefix}/{self.rank}"
        retry(
            lambda: self.store.set(key, payload),
            backoff=_STORE_BACKOFF,
            breaker=self._breaker,
            operation="heartbeat store.set",
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a missed beat is what the monitor detects
                pass

    def start(self) -> Heartbeat:
        """Beat once now, then every ``interval_s`` in a daemon thread."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="torsh-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, done: bool = False) -> None:
        """Stop beating: the monitor then sees this rank go silent, unless ``done`` (a last
        beat says the rank finished on purpose, so a slower peer's monitor does not call it
        failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if done:
            self._done = True
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the store may be gone at the very end
                pass

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HealthMonitor:
    """Classify every rank from its heartbeats.

    Args:
        store: The store the heartbeats go to.
        world_size: Ranks to watch (``0 .. world_size-1``).
        interval_s: The heartbeats' interval.
        degraded_after_s: Silence that makes a rank ``degraded``; default 3 intervals.
        failed_after_s: Silence that makes a rank ``failed``; default 10 intervals.
        slow_factor: A rank whose reported step time exceeds this multiple of the median is
            ``degraded`` (a straggler).
        prefix: Key prefix used by the heartbeats.
        clock: Time source (tests pass a fake one).
    """

    def __init__(
        self,
        store: dist.Store,
        world_size: int,
        *,
        interval_s: float = 1.0,
        degraded_after_s: float | None = None,
        failed_after_s: float | None = None,
        slow_factor: float = 2.0,
        prefix: str = _PREFIX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.world_size, self.prefix = store, world_size, prefix
        self.degraded_after_s = degraded_after_s if degraded_after_s is not None else 3 * interval_s
        self.failed_after_s = failed_after_s if failed_after_s is not None else 10 * interval_s
        if not 0 < self.degraded_after_s <= self.failed_after_s:
            raise ValueError("need 0 < degraded_after_s <= failed_after_s")
        self.slow_factor = slow_factor
        self._clock = clock
        self._started = clock()
        self._seen: dict[int, tuple[int, float, dict]] = {}  # rank -> (seq, local time, payload)

    def _read(self, rank: int) -> dict | None:
        key = f"{self.prefix}/{rank}"

        def get() -> dict | None:
            if not self.store.check([key]):  # get() would block until the key appears
                return None
            return json.loads(self.store.get(key))

        return retry(get, backoff=_STORE_BACKOFF, operation="health store.get")

    def poll(self) -> list[RankHealth]:
        """Read every heartbeat once and return each rank's health."""
        now = self._clock()
        for rank in range(self.world_size):
            payload = self._read(rank)
            if payload is None:
                continue
            seen = self._seen.get(rank)
            if seen is None or seen[0] != payload.get("seq"):
                self._seen[rank] = (int(payload.get("seq", 0)), now, payload)
        times = [s[2].get("step_time_s") for s in self._seen.values()]
        times = [t for t in times if isinstance(t, (int, float)) and t > 0]
        median = statistics.median(times) if times else None
        report = []
        for rank in range(self.world_size):
            seen = self._seen.get(rank)
            silent = now - (seen[1] if seen else self._started)
            payload = seen[2] if seen else {}
            step, step_time = payload.get("step"), payload.get("step_time_s")
            state, reason = HEALTHY, ""
            if silent >= self.failed_after_s:
                state = FAILED
                reason = (
                    f"no heartbeat for {silent:.1f} s (failed after {self.failed_after_s:g} s)"
                    if seen
                    else f"never sent a heartbeat in {silent:.1f} s"
                )
            elif silent >= self.degraded_after_s:
                state, reason = DEGRADED, f"heartbeat late: silent for {silent:.1f} s"
            elif median and step_time and step_time > self.slow_factor * median:
                state = DEGRADED
                reason = f"straggler: step time {step_time:.3f} s is {step_time / median:.1f}x the median"
            report.append(
                RankHealth(
                    rank=rank,
                    state=state,
                    reason=reason,
                    silent_s=silent,
                    step=step,
                    step_time_s=step_time,
                    info=dict(payload.get("info") or {}),
                )
            )
        return report


@dataclass(frozen=True, slots=True)
class RankStepStats:
    """Step-time statistics of one rank."""

    rank: int
    min_s: float
    median_s: float
    max_s: float
    cost_s: float
    """Sum over steps of how much longer this rank took than the median rank of that step."""


@dataclass(frozen=True, slots=True)
class StragglerReport:
    """Output of :func:`straggler_report`."""

    ranks: list[RankStepStats]
    """One entry per rank, by rank."""
    slowest: list[RankStepStats]
    """The ``k`` ranks with the highest cost, slowest first."""
    num_steps: int
    """Steps analysed."""

    def format(self) -> str:
        """A markdown table plus one line naming the slowest ranks."""
        lines = ["| rank | min s | median s | max s | cost s |", "|---|---|---|---|---|"]
        lines += [
            f"| {r.rank} | {r.min_s:.4f} | {r.median_s:.4f} | {r.max_s:.4f} | {r.cost_s:.3f} |"
            for r in self.ranks
        ]
        names = ", ".join(f"rank {r.rank} ({r.cost_s:.3f} s)" for r in self.slowest)
        lines.append(f"slowest over {self.num_steps} steps: {names}")
        return "\n".join(lines)


def straggler_report(step_times: Sequence[Sequence[float]], *, k: int = 1) -> StragglerReport:
    """Analyse per-rank step times (``step_times[rank][step]``, equal lengths).

    Raises:
        ValueError: no ranks, unequal lengths, or ``k`` out of range.
    """
    if not step_times or not step_times[0]:
        raise ValueError("step_times needs at least one rank with one step")
    num_steps = len(step_times[0])
    if any(len(t) != num_steps for t in step_times):
        raise ValueError("every rank must report the same number of steps")
    if not 1 <= k <= len(step_times):
        raise ValueError(f"k must be in [1, {len(step_times)}], got {k}")
    medians = [statistics.median(t[s] for t in step_times) for s in range(num_steps)]
    ranks = [
        RankStepStats(
            rank=rank,
            min_s=min(times),
            median_s=statistics.median(times),
            max_s=max(times),
            cost_s=sum(max(0.0, times[s] - medians[s]) for s in range(num_steps)),
        )
        for rank, times in enumerate(step_times)
    ]
    slowest = sorted(ranks, key=lambda r: (-r.cost_s, r.rank))[:k]
    return StragglerReport(ranks=ranks, slowest=slowest, num_steps=num_steps)


def gather_step_times(
    times: Sequence[float], *, group: dist.ProcessGroup | None = None
) -> list[list[float]]:
    """All-gather every rank's step times (same count on each rank); one list per rank."""
    local = torch.tensor(list(times), dtype=torch.float64)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [local.tolist()]
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return [t.tolist() for t in out]
