"""SecAgg+'s stage deadline: a stage never closes sooner than its wait after the first answer,
so a host that slowed down after the start-up probe does not drop live clients (issue 37/44)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from torsh_distributed.federated._secagg_driver import CountingGrid


def _messages(count: int) -> list[Any]:
    return [SimpleNamespace(has_error=lambda: True) for _ in range(count)]  # no records to count


class _Clock:
    """A stage's time: it moves only when the stage sleeps, so its deadlines are exact whatever
    the host's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Grid:
    """Answers message i at ``delays[i]`` seconds after it was pushed (None: never)."""

    def __init__(self, delays: list[float | None], clock: _Clock) -> None:
        self.delays = delays
        self.clock = clock
        self.sent = 0.0

    def push_messages(self, messages: list[Any]) -> list[str]:
        self.sent = self.clock()
        return [f"m{i}" for i in range(len(messages))]

    def pull_messages(self, ids: set[str]) -> list[Any]:
        now = self.clock() - self.sent
        due = [i for i in ids if self.delays[int(i[1:])] is not None and self.delays[int(i[1:])] <= now]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i, src_node_id=int(i[1:])),
                                has_error=lambda: True) for i in due]  # fmt: skip


POLL = 0.02


def _grid(delays: list[float | None], **kwargs: float) -> tuple[CountingGrid, _Clock]:
    clock = _Clock()
    return CountingGrid(_Grid(delays, clock), poll=POLL, clock=clock, sleep=clock.sleep, **kwargs), clock


def test_a_late_first_answer_extends_the_stage_for_the_others() -> None:
    # the stage's own deadline (0.4 s) passes before anyone answers; the first answer at 0.6 s
    # gives the others 0.5 s more, so the one at 0.9 s is kept and the dead one is waited for
    # until 1.1 s (the first pull at or after it)
    grid, clock = _grid([0.6, 0.9, None], after_first=0.5, silent_grace=1.0)
    replies = grid.send_and_receive(_messages(3), timeout=0.4)
    assert sorted(r.metadata.src_node_id for r in replies) == [0, 1]
    assert 1.1 - 1e-9 <= clock.now < 1.1 + POLL + 1e-9, clock.now


def test_without_the_extension_the_same_stage_closes_empty() -> None:
    grid, clock = _grid([0.6, 0.9, None])
    assert grid.send_and_receive(_messages(3), timeout=0.4) == []
    assert 0.4 - 1e-9 <= clock.now < 0.4 + POLL + 1e-9, clock.now


def test_a_silent_stage_waits_its_grace_then_closes_empty() -> None:
    grid, clock = _grid([None, None], after_first=0.5, silent_grace=0.3)
    assert grid.send_and_receive(_messages(2), timeout=0.2) == []
    assert 0.5 - 1e-9 <= clock.now < 0.5 + POLL + 1e-9, clock.now


def test_a_stage_reads_the_real_clock_by_default() -> None:
    grid = CountingGrid(SimpleNamespace(), poll=POLL)
    assert (grid.clock, grid.sleep) == (time.monotonic, time.sleep)
