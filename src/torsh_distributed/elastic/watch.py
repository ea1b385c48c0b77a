"""The job's health watch: every rank beats, rank 0 names the ranks that go silent or lag.

:class:`HealthWatch` wires :class:`~torsh_distributed.elastic.health.Heartbeat` and
:class:`~torsh_distributed.elastic.health.HealthMonitor` into a running job through the process
group's own store (no extra server): each rank publishes ``{step, busy time, node, host}`` every
``interval_s``; rank 0 polls all of them from a background thread and prints one line whenever
a rank changes state, naming rank, node and host::

    health: rank 3 (node 1, host gpu07 (10.0.0.8)) FAILED: no heartbeat for 5.1 s (last step 41)
    health: rank 2 (node 1, host gpu07 (10.0.0.8)) degraded: straggler: busy 0.310 s is 2.4x the median
    health: rank 2 (node 1, host gpu07 (10.0.0.8)) healthy again

What it sees. A hung rank (stopped, deadlocked, its host unreachable) stops beating while the
others wait in a collective: the watch names it long before the collective's timeout. A rank
whose process died usually breaks the others' collectives at once ("connection closed by
peer"), so the job fails or restarts before the watch speaks; the launcher's failure report and
the resumed run's ``left: HOST (ranks ...)`` line name it then. A straggler shows a larger *busy*
time (its step minus the time it waited for others), which needs the step monitor's phases
(``--monitor``); without them only liveness is watched.

Heartbeats run in daemon threads; the store's client serialises them with the process group's
own requests. Cost: one small ``set`` per rank and ``world_size`` reads on rank 0 per interval.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from torsh_distributed.elastic.health import FAILED, HEALTHY, HealthMonitor, Heartbeat, RankHealth

__all__ = ["HealthWatch", "describe"]

_PREFIX = "torsh/health"


def describe(health: RankHealth) -> str:
    """``rank R (node N, host H)``: where a rank runs, from its heartbeat."""
    info = health.info
    where = ", ".join(
        f"{key} {info[key]}" for key in ("node", "host") if info.get(key) not in (None, "")
    )
    return f"rank {health.rank}" + (f" ({where})" if where else "")


class HealthWatch:
    """Heartbeats on every rank; on rank 0, a thread that reports state changes.

    Args:
        store: A store every rank reaches (the default process group's); keys go under
            ``torsh/health/``.
        rank: This rank.
        world_size: Ranks in the job.
        interval_s: Seconds between heartbeats and between rank 0's polls.
        failed_after_intervals: Silent intervals after which a rank is reported FAILED (and
            after a third of them, degraded). Lower names a hang sooner; higher tolerates long
            pauses such as a slow checkpoint save or a first-step compile.
        info: This rank's facts for the reports (``{"node": 1, "host": "gpu07"}``).
        echo: Prints a line (rank 0); ``print`` by default.
        clock: Time source of the busy-time measurement (tests).
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        interval_s: float = 1.0,
        failed_after_intervals: float = 10.0,
        info: dict | None = None,
        echo: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if not failed_after_intervals >= 1:
            raise ValueError(f"failed_after_intervals must be >= 1, got {failed_after_intervals}")
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self._echo = echo or (lambda text: print(text, flush=True))
        self._clock = clock
        self.heartbeat = Heartbeat(
            dist.PrefixStore(_PREFIX, store), rank, interval_s=interval_s, info=info
        )
        self.monitor: HealthMonitor | None = None
        if rank == 0:
            failed = failed_after_intervals * interval_s
            self.monitor = HealthMonitor(
                dist.PrefixStore(_PREFIX, store),
                world_size,
                interval_s=interval_s,
                degraded_after_s=max(interval_s, failed / 3),
                failed_after_s=failed,
            )
        self.events: list[tuple[float, int, str, str]] = []
        """``(unix time, rank, state, reason)`` of every reported change (rank 0)."""
        self._states: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_end: float | None = None
        self.started = False

    # -- the training loop's call ----------------------------------------------------------
    def step_end(self, step: int, *, comm_wait_s: float | None = None) -> None:
        """``step`` steps are done. ``comm_wait_s``: time of this step spent waiting for the
        others (from the step monitor); the busy time sent is the whole iteration since the last
        call (data loading and anything between steps included) minus that wait. Without it
        only liveness is reported."""
        now = self._clock()
        busy = None
        if self._last_end is not None and comm_wait_s is not None:
            busy = max(0.0, now - self._last_end - comm_wait_s)
        self._last_end = now
        self.heartbeat.update(step, busy)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> HealthWatch:
        """Beat now and every interval; on rank 0 start watching."""
        self.heartbeat.start()
        if self.monitor is not None:
            self._thread = threading.Thread(target=self._watch, name="torsh-health", daemon=True)
            self._thread.start()
        self.started = True
        return self

    def stop(self) -> None:
        """Stop watching, send a last "done" beat (idempotent)."""
        if not self.started:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.heartbeat.stop(done=True)
        self.started = False

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the store may be gone while the job ends
                return

    def check(self) -> list[str]:
        """Poll every rank once; print (and return) a line for each rank whose state changed."""
        assert self.monitor is not None, "only rank 0 watches"
        lines = []
        for health in self.monitor.poll():
            if health.info.get("done"):
                continue  # finished on purpose: its silence is not a failure
            before = self._states.get(health.rank, HEALTHY)
            if health.state == before:
                continue
            self._states[health.rank] = health.state
            if health.state == HEALTHY:
                line = f"health: {describe(health)} healthy again"
            else:
                state = "FAILED" if health.state == FAILED else health.state
                last = f" (last step {health.step})" if health.step is not None else ""
                line = f"health: {describe(health)} {state}: {health.reason}{last}"
            self.events.append((time.time(), health.rank, health.state, health.reason))
            lines.append(line)
            self._echo(line)
        return lines
