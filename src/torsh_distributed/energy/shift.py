"""Carbon-aware time shifting: pause training while the grid is dirtier than a threshold.

With ``--carbon.max-intensity X`` and ``--carbon.series FILE`` the job pauses (after a checkpoint
when ``--checkpoint.dir`` is set) while the series' intensity is above X gCO2/kWh and resumes at
the first slot at or below X. ``--carbon.deadline`` bounds it: no pause that would make the
training end after the deadline, by the measured step time.

Two parts:

* :class:`ShiftPolicy` is the decision, pure and clock-free: given the series, the threshold, the
  deadline, the time, the steps left and the step time, :meth:`ShiftPolicy.decide` says run,
  pause (until when) or run through a dirty slot for the deadline, and when the decision can
  next change.
* :class:`TimeShift` drives it in the loop: rank 0 decides and broadcasts the decision with
  the step of the next check, so every rank pauses at the same step for the same time. Between
  checks a step costs one integer comparison; checks come when a dirty slot may have begun (the
  time to it halved at each check, so a slot boundary is found within one step while steps run
  under twice the mean step time, with a handful of checks per boundary).

The rules where the series says nothing: before its first slot and after its last the job runs
(there is no intensity to shift by); a dirty slot with no clean slot after it in the series
pauses until the series ends. The first decision comes after the first step, which gives the
step time the deadline needs.
"""

from __future__ import annotations

import bisect
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from torsh_distributed.energy.carbon import IntensitySeries
from torsh_distributed.energy.refresh import cap_gap

__all__ = ["Broadcast", "Decision", "ShiftPolicy", "TimeShift", "clock_text", "default_broadcast", "parse_deadline"]

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_deadline(text: str) -> tuple[Literal["at", "after"], float]:
    """``("at", unix seconds)`` for an ISO 8601 time (no zone: UTC), ``("after", seconds)`` for a
    duration (``30m``, ``90s``, ``2h``, ``1h30m``) counted from the first step.

    Raises:
        ValueError: neither (a bare number is refused: seconds or a unix time would be a guess).
    """
    raw = text.strip()
    match = _DURATION.match(raw.lower())
    if raw and match and any(match.groups()):
        hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
        total = hours * 3600 + minutes * 60 + seconds
        if total <= 0:
            raise ValueError(f"carbon.deadline {text!r}: a duration must be > 0")
        return "after", total
    iso = raw[:-1] + "+00:00" if raw.endswith(("Z", "z")) else raw
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(
            f"carbon.deadline {text!r} is neither an ISO 8601 time (2026-11-26T18:00:00Z; no zone "
            "means UTC) nor a duration from the first step (30m, 90s, 1h30m)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return "at", moment.timestamp()


def clock_text(t: float) -> str:
    """``12:00:05 UTC``, or with the date when ``t`` is not today (UTC)."""
    moment = datetime.fromtimestamp(t, tz=timezone.utc)
    if moment.date() == datetime.now(tz=timezone.utc).date():
        return moment.strftime("%H:%M:%S UTC")
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


Action = Literal["run", "pause", "through"]


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do now, and until when it holds."""

    action: Action
    """``run`` (clean, or no data), ``pause`` (until ``resume_at``) or ``through`` (a dirty slot
    run through because pausing would miss the deadline)."""
    recheck_s: float
    """Seconds until the decision may change (``inf``: never again)."""
    intensity: float | None = None
    """The intensity now (``None`` outside the series)."""
    slot: int = -1
    """The series' slot now (-1 outside it)."""
    resume_at: float = math.nan
    """``pause`` and ``through``: unix time of the first clean slot (or of the series' end)."""
    resume_intensity: float | None = None
    """The intensity there (``None`` when it is the series' end)."""
    finish_at: float = math.nan
    """``through``: when training would end had it paused."""


@dataclass(frozen=True, slots=True)
class ShiftPolicy:
    """The time-shifting decision (see the module doc); clock-free, so tests give the time.

    Args:
        series: The intensity series (absolute slots).
        max_intensity: Pause above this, in gCO2/kWh (> 0).
        deadline: Unix time training must end by, or ``None`` (pauses are unbounded).
    """

    series: IntensitySeries
    max_intensity: float
    deadline: float | None = None
    _next_dirty: tuple[int, ...] = field(init=False, repr=False)
    _next_clean: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_intensity) and self.max_intensity > 0):
            raise ValueError(f"carbon.max_intensity must be > 0 gCO2/kWh, got {self.max_intensity}")
        n = len(self.series.values)
        dirty, clean = [n] * (n + 1), [n] * (n + 1)  # first dirty / clean slot at index >= i
        for i in range(n - 1, -1, -1):
            over = self.series.values[i] > self.max_intensity
            dirty[i] = i if over else dirty[i + 1]
            clean[i] = clean[i + 1] if over else i
        object.__setattr__(self, "_next_dirty", tuple(dirty))
        object.__setattr__(self, "_next_clean", tuple(clean))

    def check(self, now: float) -> None:
        """Refuse settings that cannot work from ``now`` on (before training starts).

        Raises:
            ValueError: the series ends before ``now``, or the deadline has passed.
        """
        end = self.series.ends[-1]
        if end <= now:
            raise ValueError(
                f"carbon.series {self.series.detail} ends at {clock_text(end)}, before now "
                f"({clock_text(now)}): time shifting needs the intensity ahead of the run; give "
                "a current series (or forecast), or drop --carbon.max-intensity"
            )
        if self.deadline is not None and self.deadline <= now:
            raise ValueError(
                f"carbon.deadline {clock_text(self.deadline)} is already past (now {clock_text(now)})"
            )

    def decide(self, now: float, *, steps_left: int, step_s: float) -> Decision:
        """Run, pause or run through a dirty slot, at unix time ``now`` with ``steps_left``
        steps of ``step_s`` seconds each still to train."""
        s, limit = self.series, self.max_intensity
        n = len(s.values)
        if now >= s.ends[-1] or steps_left <= 0:
            return Decision("run", math.inf)
        if now < s.starts[0]:
            return Decision("run", self._start_of(self._next_dirty[0]) - now)
        i = bisect.bisect_right(s.starts, now) - 1
        value = s.values[i]
        if value <= limit:
            return Decision("run", self._start_of(self._next_dirty[i + 1]) - now, value, i)
        j = self._next_clean[i + 1]
        resume = self._start_of(j) if j < n else s.ends[-1]
        after = s.values[j] if j < n else None
        if self.deadline is not None:
            finish = resume + steps_left * step_s
            if finish > self.deadline:
                # pausing becomes possible once that much of the work is done in the dirty slot
                return Decision("through", min(finish - self.deadline, resume - now), value, i,
                                resume_at=resume, resume_intensity=after, finish_at=finish)
        return Decision("pause", 0.0, value, i, resume_at=resume, resume_intensity=after)

    def _start_of(self, index: int) -> float:
        return self.series.starts[index] if index < len(self.series.values) else math.inf


Broadcast = Callable[[list[float]], list[float]]

_CODES: dict[Action, int] = {"run": 0, "pause": 1, "through": 2}


class TimeShift:
    """Time shifting in the training loop (see the module doc); every rank builds one with the
    same arguments, and :meth:`step_end` is collective on the steps rank 0 names.

    Args:
        policy_of: Builds rank 0's policy from the start time (a duration deadline counts
            from it), e.g. :meth:`CarbonConfig.shift_policy
            <torsh_distributed.energy.config.CarbonConfig.shift_policy>`; ``None``: off (every
            method returns at once). Called on rank 0 only.
        main: Whether this is rank 0 (it decides and prints).
        start_step: The step this process starts at (a resumed run's).
        max_steps: The run's last step (no pause after it).
        write: Prints a line on rank 0.
        broadcast: Rank 0's floats to every rank (collective); default: a float64 tensor
            broadcast on the default process group, on ``device``.
        device: Where that tensor lives (the rank's CUDA device under NCCL).
        clock: Unix time (the series' time line).
        sleep: Waits that many seconds (tests pass a fake that moves their clock).
        refresh: Rank 0's new policy when the series file changed, else ``None``
            (:class:`~torsh_distributed.energy.refresh.SeriesWatch`); ``None``: read once.
        refresh_s: With ``refresh``: checks come at least this many seconds of steps apart.

    Raises:
        ValueError: on every rank, when rank 0 finds the series ended or the deadline past.
    """

    def __init__(
        self,
        policy_of: Callable[[float], ShiftPolicy] | None,
        *,
        main: bool,
        start_step: int,
        max_steps: int,
        write: Callable[[str], None] = print,
        broadcast: Broadcast | None = None,
        device: Any = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        refresh: Callable[[], ShiftPolicy | None] | None = None,
        refresh_s: float = math.inf,
    ) -> None:
        self.on = policy_of is not None
        self.refresh, self.refresh_s = refresh, refresh_s if refresh is not None else math.inf
        self.main, self.max_steps = main, max_steps
        self.write, self.clock, self.sleep = write, clock, sleep
        self._broadcast = broadcast or default_broadcast(device)
        self.pauses: list[dict[str, Any]] = []
        self.through: list[dict[str, Any]] = []
        self.checks = 0
        self.max_intensity = 0.0
        self.deadline: float | None = None
        self.ended: float | None = None
        self.started = 0.0
        """Unix time this driver started (its policy's start: a duration deadline counts from it)."""
        if policy_of is None:
            return
        self._start_step = self._next_check = start_step + 1  # the first step gives the step time
        self._t0 = self.started = clock()
        self._paused = 0.0
        self._said_through: set[int] = set()
        self._said_end = False
        error, message = "", [0.0, math.nan, 0.0]
        if main:  # an error raised on one rank only would leave the others in the broadcast
            try:
                self.policy = policy_of(self._t0)
                try:
                    self.policy.check(self._t0)
                except ValueError as exc:
                    if start_step == 0:
                        raise
                    # a resumed attempt (a restart, a later segment): refusing would lose the
                    # work; past the series' end or the deadline, decide() never pauses
                    self.write(f"carbon: time shifting has nothing left to do on this resumed run ({exc})")
                deadline = self.policy.deadline
                message = [0.0, math.nan if deadline is None else deadline, self.policy.max_intensity]
            except ValueError as exc:
                error, message[0] = str(exc), 1.0
        code, at, self.max_intensity = self._broadcast(message)
        if error:
            raise ValueError(error)
        if code:
            raise ValueError("carbon: rank 0 refused the time-shifting settings (its error says why)")
        self.deadline = None if math.isnan(at) else at
        if main:
            self.write(self._plan_line(self.policy.series))

    def _plan_line(self, series: IntensitySeries) -> str:
        first, last = series.starts[0], series.ends[-1]
        line = (f"carbon: time shifting: pausing while the intensity is above {self.max_intensity:g} "
                f"g/kWh ({series.detail}: {clock_text(first)} to {clock_text(last)})")
        if self.deadline is not None:
            line += f", deadline {clock_text(self.deadline)}"
        if first > self._t0:
            line += f"; no data before {clock_text(first)}: no pause until then"
        return line

    def step_end(
        self,
        step: int,
        *,
        save: Callable[[], None] | None = None,
        mark: Callable[[], None] | None = None,
    ) -> None:
        """After ``step`` steps: on a check step, rank 0 decides and every rank follows; a
        pause first calls ``save`` (a checkpoint, collective) and then waits. ``mark`` is
        called as a pause starts and as it ends: the energy meter's readings there keep the
        energy spent before the pause from being spread over the pause's dirty slot."""
        if not self.on:
            return
        if step >= self.max_steps:
            self.ended = self.clock()
            return
        if step < self._next_check:
            return
        self.checks += 1
        message = self._decide(step) if self.main else [0.0] * 5
        code, pause_s, next_check, intensity, start = self._broadcast(message)
        self._next_check = int(next_check)
        if code == _CODES["through"]:  # sent once per dirty slot
            self.through.append({"step": step, "start": start, "intensity": intensity})
        if code != _CODES["pause"]:
            return
        began = self.clock()
        if mark is not None:
            mark()
        if save is not None:
            save()
        if self.main:  # rank 0 waits for the slot itself; the others for as long
            while (left := start + pause_s - self.clock()) > 0:
                self.sleep(left)
        elif (left := pause_s - (self.clock() - began)) > 0:
            self.sleep(left)
        seconds = self.clock() - began
        if mark is not None:
            mark()
        self._paused += seconds
        self.pauses.append({"step": step, "start": began, "seconds": seconds, "intensity": intensity})

    def _decide(self, step: int) -> list[float]:
        if self.refresh is not None and (fresh := self.refresh()) is not None:
            self.policy, self._said_through, self._said_end = fresh, set(), False
        now = self.clock()
        done = step - self._start_step + 1
        step_s = max((now - self._t0 - self._paused) / done, 1e-6)
        steps_left = self.max_steps - step
        d = self.policy.decide(now, steps_left=steps_left, step_s=step_s)
        limit = f"{self.max_intensity:g}"
        if d.action == "pause":
            after = (f"next slot {d.resume_intensity:g} g/kWh" if d.resume_intensity is not None
                     else "the series ends there: no data after it")
            self.write(f"carbon: intensity {d.intensity:g} g/kWh > {limit} at step {step}: paused "
                       f"{d.resume_at - now:.1f} s until {clock_text(d.resume_at)} ({after})")
            return [1.0, d.resume_at - now, step + 1.0, float(d.intensity or 0.0), now]
        action = d.action
        if action == "through" and d.slot in self._said_through:
            action = "run"  # said once per slot
        elif action == "through":
            self._said_through.add(d.slot)
            assert self.deadline is not None
            self.write(f"carbon: intensity {d.intensity:g} g/kWh > {limit} at step {step}: not pausing: "
                       f"resuming at {clock_text(d.resume_at)} would end training about "
                       f"{clock_text(d.finish_at)}, after the deadline {clock_text(self.deadline)} "
                       f"({steps_left} steps left x {step_s:.3g} s)")
        if d.action == "run" and math.isinf(d.recheck_s) and not self._said_end:
            self._said_end = True
            if now >= self.policy.series.ends[-1]:
                self.write(f"carbon: the series ends at {clock_text(self.policy.series.ends[-1])}: "
                           "no intensity data after it, so no more pauses")
        gap = self.max_steps if math.isinf(d.recheck_s) else max(1, int(d.recheck_s / (2 * step_s)))
        gap = cap_gap(gap, every_s=self.refresh_s, step_s=step_s)
        return [float(_CODES[action]), 0.0, float(min(step + gap, self.max_steps)),
                float(d.intensity if d.intensity is not None else math.nan), now]

    def summary(self) -> dict[str, Any]:
        """The ``carbon`` block's time-shifting fields ({} when off)."""
        if not self.on:
            return {}
        deadline = self.deadline
        return {
            "max_intensity_g_per_kwh": self.max_intensity,
            "pauses": [dict(p) for p in self.pauses],
            "paused_s": sum(p["seconds"] for p in self.pauses),
            "ran_through": [dict(t) for t in self.through],
            "deadline": None if deadline is None else datetime.fromtimestamp(deadline, tz=timezone.utc).isoformat(),
            "deadline_unix_s": deadline,
            "ended_unix_s": self.ended,
            "met_deadline": None if deadline is None or self.ended is None else self.ended <= deadline,
            "shift_checks": self.checks,
        }


def default_broadcast(device: Any) -> Broadcast:
    def broadcast(values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.broadcast(tensor, src=0)
        return tensor.tolist()

    return broadcast
