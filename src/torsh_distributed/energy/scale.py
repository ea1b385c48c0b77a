"""Carbon-aware scaling: more workers while the grid is clean, fewer while it is dirty.

With ``--carbon.scale`` and ``--carbon.series FILE``, ``torsh-dist train --nproc-per-node MIN:MAX``
runs the job in segments, each at one world size (CarbonScaler's idea, SIGMETRICS '24, with a
simpler rule than its marginal-capacity optimiser). The launcher starts a segment at the size the
series asks for now; the job checkpoints and ends the segment when the series asks for another
size; the launcher starts the next segment at the new size from that checkpoint. The sample
order does not depend on the world size, so the resumed job trains the same steps.

Three parts:

* :class:`ScalePolicy` is the rule, pure and clock-free: the series' cleanest slot gets MAX
  workers, its dirtiest MIN, linearly in between (rounded to the nearest size, then down to a
  size the job can run at: one the global batch divides); outside the series, MAX (there is no
  intensity to scale by: the job runs as a carbon-agnostic one would).
* :class:`CarbonScale` drives it in the loop: rank 0 checks at the steps when the target may
  have changed (the time to the next change halved at each check, as time shifting does) and
  broadcasts the decision, so every rank stops at the same step. A change is made only when it
  pays for a restart: the new size must hold longer than this segment's start-up took, and the
  work left must take longer than that too.
* :func:`scaling_summary` is the job's view at its end: every segment's world size, steps,
  joules and grams, the decisions, and the totals.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torsh_distributed.energy.carbon import IntensitySeries
from torsh_distributed.energy.refresh import cap_gap
from torsh_distributed.energy.shift import Broadcast, clock_text, default_broadcast

__all__ = ["CarbonScale", "ScalePolicy", "Target", "check_ahead", "scaling_summary"]


@dataclass(frozen=True, slots=True)
class Target:
    """The world size the series asks for at one instant, and for how long."""

    world_size: int
    intensity: float | None
    """The intensity then (``None`` outside the series)."""
    slot: int
    """The series' slot (-1 outside it)."""
    holds_s: float
    """Seconds until the target changes (``inf``: never again)."""


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    """The world size for each slot of a series (see the module doc); tests give the time.

    Args:
        series: The intensity series (absolute slots).
        min_size: World size in the dirtiest slot (>= 1).
        max_size: World size in the cleanest slot and outside the series (> ``min_size``).
        sizes: The sizes the job can run at, with ``min_size`` and ``max_size`` (empty: every
            size between them); a linear target between two of them rounds down.
    """

    series: IntensitySeries
    min_size: int
    max_size: int
    sizes: tuple[int, ...] = ()
    _targets: tuple[int, ...] = field(init=False, repr=False)
    _change_at: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (1 <= self.min_size < self.max_size):
            raise ValueError(
                f"carbon scaling needs 1 <= MIN < MAX workers, got {self.min_size}:{self.max_size}"
            )
        sizes = tuple(sorted(set(self.sizes))) or tuple(range(self.min_size, self.max_size + 1))
        if sizes[0] != self.min_size or sizes[-1] != self.max_size:
            raise ValueError(f"carbon scaling sizes {list(sizes)} must run from {self.min_size} to {self.max_size}")
        object.__setattr__(self, "sizes", sizes)
        targets = tuple(self.size_for(v) for v in self.series.values)
        n = len(targets)
        # for slot i: when the target first differs from slot i's (the series' end counts, where
        # the target becomes max_size again)
        change = [math.inf] * n
        change[-1] = math.inf if targets[-1] == self.max_size else self.series.ends[-1]
        for i in range(n - 2, -1, -1):
            change[i] = change[i + 1] if targets[i + 1] == targets[i] else self.series.starts[i + 1]
        object.__setattr__(self, "_targets", targets)
        object.__setattr__(self, "_change_at", tuple(change))

    def size_for(self, intensity: float | None) -> int:
        """MAX at the series' lowest intensity, MIN at its highest, linear in between (rounded
        half up); MAX for ``None`` (no data) or a series with one value."""
        values = self.series.values
        low, high = min(values), max(values)
        if intensity is None or high <= low:
            return self.max_size
        dirty = min(max((intensity - low) / (high - low), 0.0), 1.0)
        linear = self.max_size - math.floor(dirty * (self.max_size - self.min_size) + 0.5)
        return self.sizes[bisect.bisect_right(self.sizes, linear) - 1]

    def target(self, now: float) -> Target:
        """The world size at unix time ``now`` and how long it holds."""
        s = self.series
        if now >= s.ends[-1]:
            return Target(self.max_size, None, -1, math.inf)
        if now < s.starts[0]:
            first = next((i for i, t in enumerate(self._targets) if t != self.max_size), None)
            holds = math.inf if first is None else s.starts[first] - now
            return Target(self.max_size, None, -1, holds)
        i = bisect.bisect_right(s.starts, now) - 1
        return Target(self._targets[i], s.values[i], i, self._change_at[i] - now)

    def check(self, now: float) -> None:
        """Refuse a series that says nothing about the time ahead (see :func:`check_ahead`)."""
        check_ahead(self.series, now)


def check_ahead(series: IntensitySeries, now: float) -> None:
    """Refuse a series that ends before ``now`` (it could only ever say MAX).

    Raises:
        ValueError: the series ends before ``now``.
    """
    end = series.ends[-1]
    if end <= now:
        raise ValueError(
            f"carbon.series {series.detail} ends at {clock_text(end)}, before now "
            f"({clock_text(now)}): carbon-aware scaling needs the intensity ahead of the run; "
            "give a current series (or forecast), or drop --carbon.scale"
        )


class CarbonScale:
    """Carbon-aware scaling in the training loop (see the module doc); every rank builds one
    with the same arguments, and :meth:`step_end` is collective on the steps rank 0 names.

    Args:
        policy: Rank 0's rule (the other ranks may pass it too: only rank 0 reads it);
            ``None``: off (every method returns at once).
        world_size: The running world size.
        main: Whether this is rank 0 (it decides and prints).
        start_step: The step this segment starts at (the resumed step).
        max_steps: The run's last step (no change after it).
        launched_at: Unix time the launcher started this segment: the start-up up to the first
            step is what a restart costs (``None``: unknown, taken as 0).
        write: Prints a line on rank 0.
        broadcast: Rank 0's floats to every rank (collective); default: a float64 tensor
            broadcast on the default process group, on ``device``.
        device: Where that tensor lives.
        clock: Unix time (the series' time line).
        refresh: Rank 0's new policy when the series file changed, else ``None``
            (:class:`~torsh_distributed.energy.refresh.SeriesWatch`); ``None``: read once.
        refresh_s: With ``refresh``: checks come at least this many seconds of steps apart.
    """

    def __init__(
        self,
        policy: ScalePolicy | None,
        *,
        world_size: int,
        main: bool,
        start_step: int,
        max_steps: int,
        launched_at: float | None = None,
        write: Callable[[str], None] = print,
        broadcast: Broadcast | None = None,
        device: Any = None,
        clock: Callable[[], float] = time.time,
        refresh: Callable[[], ScalePolicy | None] | None = None,
        refresh_s: float = math.inf,
    ) -> None:
        self.on = policy is not None
        self.refresh, self.refresh_s = refresh, refresh_s if refresh is not None else math.inf
        self.policy, self.world_size, self.main = policy, world_size, main
        self.start_step, self.max_steps, self.launched_at = start_step, max_steps, launched_at
        self.write, self.clock = write, clock
        self._broadcast = broadcast or default_broadcast(device)
        self.checks = 0
        self.stop: dict[str, Any] | None = None
        """Set when this segment ends for a new world size: ``step``, ``unix_s``,
        ``intensity``, ``world_size`` (the new one)."""
        self.kept: list[dict[str, Any]] = []
        """Changes not made because a restart would not pay (once per slot)."""
        self.restart_s: float | None = None
        self._next_check = start_step + 1  # the first step gives the step time
        self._t0 = clock()
        self._said: set[int] = set()

    def step_end(self, step: int, *, save: Callable[[], None] | None = None) -> bool:
        """After ``step`` steps: on a check step rank 0 decides and every rank follows. True
        when the segment ends here for a new world size (``save``, a checkpoint, was called)."""
        if not self.on or step >= self.max_steps or step < self._next_check:
            return False
        self.checks += 1
        message = self._decide(step) if self.main else [0.0] * 5
        code, next_check, intensity, size, now = self._broadcast(message)
        self._next_check = int(next_check)
        if not code:
            return False
        self.stop = {"step": step, "unix_s": now, "intensity": None if math.isnan(intensity) else intensity,
                     "world_size": int(size)}
        if save is not None:
            save()
        return True

    def _decide(self, step: int) -> list[float]:
        assert self.policy is not None
        if self.refresh is not None and (fresh := self.refresh()) is not None:
            self.policy, self._said = fresh, set()
        now = self.clock()
        step_s = max((now - self._t0) / max(step - self.start_step, 1), 1e-6)
        if self.restart_s is None:  # start-up of this segment: launch to the first step's start
            self.restart_s = max(now - step_s - self.launched_at, 0.0) if self.launched_at else 0.0
        t = self.policy.target(now)
        left_s = (self.max_steps - step) * step_s
        value = math.nan if t.intensity is None else t.intensity
        where = f"intensity {t.intensity:g} g/kWh" if t.intensity is not None else "no intensity data"
        if t.world_size != self.world_size:
            if t.holds_s > self.restart_s and left_s > self.restart_s:
                self.write(
                    f"carbon: {where} at step {step}: world size {self.world_size} -> {t.world_size} "
                    f"(checkpoint and restart; the new size holds {_span(t.holds_s)})"
                )
                return [1.0, float(step), value, float(t.world_size), now]
            if t.slot not in self._said:
                self._said.add(t.slot)
                short = "the new size holds" if t.holds_s <= self.restart_s else "the work left takes"
                shorter = min(t.holds_s, left_s)
                self.write(
                    f"carbon: {where} at step {step} asks for world size {t.world_size}: staying at "
                    f"{self.world_size}: {short} {_span(shorter)}, less than a restart "
                    f"({self.restart_s:.1f} s)"
                )
                self.kept.append({"step": step, "unix_s": now, "intensity": t.intensity,
                                  "world_size": t.world_size})
        gap = self.max_steps if math.isinf(t.holds_s) else max(1, int(t.holds_s / (2 * step_s)))
        gap = cap_gap(gap, every_s=self.refresh_s, step_s=step_s)
        return [0.0, float(min(step + gap, self.max_steps)), value, float(self.world_size), now]

    def summary(self) -> dict[str, Any]:
        """This segment's scaling figures ({} when off)."""
        if not self.on:
            return {}
        return {"stop": self.stop, "kept": [dict(k) for k in self.kept], "checks": self.checks,
                "restart_s": self.restart_s}


def _span(seconds: float) -> str:
    return "to the end of the series and after" if math.isinf(seconds) else f"{seconds:.1f} s"


def scaling_summary(segments: list[dict[str, Any]], *, sizes: Sequence[int]) -> dict[str, Any]:
    """The ``carbon.scaling`` block of the job from its segments, oldest first.

    Each segment is ``{"index", "world_size", "launched_unix_s", "intensity" (at the launch),
    "start_step", "end_step", "first_step_unix_s", "ended_unix_s", "joules", "grams",
    "stop", "kept", "checks", "restart_s"}``; the job's figures are their sums, and
    ``decisions`` lists each segment's ``(unix_s, step, intensity, world_size)``; ``sizes`` are
    the world sizes the job could run at.
    """
    joules = [s.get("joules") for s in segments]
    grams = [s.get("grams") for s in segments]
    return {
        "min_world_size": min(sizes),
        "max_world_size": max(sizes),
        "sizes": sorted(sizes),
        "decisions": [
            {"unix_s": s["launched_unix_s"], "step": s["start_step"], "intensity": s.get("intensity"),
             "world_size": s["world_size"]}
            for s in segments
        ],
        "world_sizes": [s["world_size"] for s in segments],
        "restarts": max(len(segments) - 1, 0),
        "joules": None if None in joules else sum(joules),  # type: ignore[arg-type]
        "grams": None if None in grams else sum(grams),  # type: ignore[arg-type]
        "steps": sum(s["end_step"] - s["start_step"] for s in segments),
        "wall_s": segments[-1]["ended_unix_s"] - segments[0]["launched_unix_s"] if segments else 0.0,
        "segments": [dict(s) for s in segments],
    }
