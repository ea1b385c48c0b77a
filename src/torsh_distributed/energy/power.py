"""GPU power limits: a fixed limit, or a Zeus-style search for the job's energy-optimal one.

Zeus (You et al., NSDI '23) observes that a DNN job's GPU energy falls steeply as the power
limit drops below the maximum while its step time grows slowly, so a limit below the default
often costs little time and saves much energy. It profiles the job's own steps at each limit
("just-in-time", while training goes on) and keeps the limit that minimises

    cost = eta * energy_per_step + (1 - eta) * max_power * seconds_per_step

where ``eta`` (``--energy.power-tradeoff``) weighs energy against time: 1 counts energy only,
0 time only, and ``max_power`` (the GPUs' largest limit) turns seconds into joules at full power.

:class:`PowerLimit` does that on every CUDA rank of a job, in lockstep (every rank takes the same
steps): from the largest limit downwards in ``--energy.power-stride-w`` steps, two warm-up steps
after each change, then ``--energy.power-steps`` measured steps (the NVML counter and a
synchronised clock at the window's ends). A data-parallel job is as fast as its slowest rank and
uses every GPU's energy, so the job's figures per limit are the sum of the ranks' joules and the
largest of their seconds; every rank applies the one limit that minimises the job's cost. The
limit in force before the run is put back when the run ends (and at interpreter exit, if the run
fails).

Setting a limit needs administrator rights on most hosts (``nvidia-smi -pl`` has the same rule);
where NVML refuses it on any rank, no rank changes its limit and the report says why.
"""

from __future__ import annotations

import atexit
import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PowerLimit", "candidate_limits", "choose_limit", "parse_power_limit"]

WARMUP_STEPS = 2
"""Steps run after each change of limit before the window opens (the clocks settle)."""


def parse_power_limit(value: str) -> float | None:
    """``off`` -> ``None``; ``search`` -> ``nan``; a number of watts -> that number.

    Raises:
        ValueError: anything else, or a number that is not > 0.
    """
    text = value.strip().lower()
    if text == "off":
        return None
    if text == "search":
        return math.nan
    try:
        watts = float(text.removesuffix("w"))
    except ValueError:
        raise ValueError(
            f"energy.power_limit must be off, search or a limit in watts (300, 250W), got {value!r}"
        ) from None
    if not (math.isfinite(watts) and watts > 0):
        raise ValueError(f"energy.power_limit must be > 0 W, got {value!r}")
    return watts


def candidate_limits(min_w: float, max_w: float, stride_w: float) -> list[float]:
    """The limits searched: ``max_w``, ``max_w - stride_w``, ... down to ``min_w`` (always
    included), in watts."""
    out: list[float] = []
    watts = max_w
    while watts > min_w + 1e-9:
        out.append(watts)
        watts -= stride_w
    out.append(min_w)
    return out


def choose_limit(
    limits: Sequence[float], per_rank: Sequence[Sequence[tuple[float, float]]], *, tradeoff: float, max_power_w: float
) -> tuple[int, list[dict[str, float]]]:
    """The index of the limit with the least job cost, and every limit's figures.

    Args:
        limits: The limits profiled, in watts.
        per_rank: For each rank, ``(joules, seconds)`` per step at each limit.
        tradeoff: ``eta`` of the cost (see the module doc), in [0, 1].
        max_power_w: The job's power at full limits (the sum of the ranks' largest limits).
    """
    rows: list[dict[str, float]] = []
    for i, watts in enumerate(limits):
        joules = sum(rank[i][0] for rank in per_rank)
        seconds = max(rank[i][1] for rank in per_rank)
        cost = tradeoff * joules + (1 - tradeoff) * max_power_w * seconds
        rows.append({"limit_w": watts, "joules_per_step": joules, "seconds_per_step": seconds, "cost": cost})
    best = min(range(len(rows)), key=lambda i: (rows[i]["cost"], -limits[i]))
    return best, rows


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class PowerLimit:
    """One rank's GPU power limit over a run: fixed, or searched (see the module doc).

    Args:
        nvml: The ``pynvml`` module (or, in tests, an object with the calls used here).
        handle: This rank's NVML device handle (the energy meter's).
        read_joules: The rank's energy meter (cumulative joules of this GPU).
        limit_w: A fixed limit in watts, or ``nan`` to search.
        tradeoff: ``eta`` of the search's cost.
        steps: Measured steps per limit.
        stride_w: Watts between two limits searched.
        clock: Seconds (monotonic) after ``sync``.
        sync: Waits for the rank's queued GPU work (``torch.cuda.synchronize``) before a window
            end is read.
        gather: This rank's object -> every rank's, in rank order (collective); default
            ``all_gather_object`` on the default group.
    """

    def __init__(
        self,
        nvml: Any,
        handle: Any,
        read_joules: Callable[[], float],
        *,
        limit_w: float,
        tradeoff: float,
        steps: int,
        stride_w: float,
        clock: Callable[[], float],
        sync: Callable[[], None] = lambda: None,
        gather: Callable[[Any], list[Any]] = _gather,
    ) -> None:
        self._nvml, self._handle, self._read = nvml, handle, read_joules
        self._tradeoff, self._steps, self._clock, self._sync, self._gather = tradeoff, steps, clock, sync, gather
        self.search = math.isnan(limit_w)
        self.report: dict[str, Any] = {"mode": "search" if self.search else "fixed"}
        min_mw, max_mw = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        self._min_w, self._max_w = min_mw / 1000, max_mw / 1000
        self._original_mw = int(nvml.nvmlDeviceGetPowerManagementLimit(handle))
        self.report.update(range_w=[self._min_w, self._max_w], original_w=self._original_mw / 1000)
        if self.search:
            self.limits = candidate_limits(self._min_w, self._max_w, stride_w)
        else:
            if not self._min_w <= limit_w <= self._max_w:
                raise ValueError(
                    f"energy.power_limit {limit_w:g} W is outside this GPU's range "
                    f"{self._min_w:g}..{self._max_w:g} W"
                )
            self.limits = [limit_w]
        self._index = 0
        self._count = 0
        self._window: tuple[float, float] | None = None
        self._measured: list[tuple[float, float]] = []
        self.active = True
        self._changed = False

    def start(self) -> None:
        """Set the first limit on every rank (collective); where any rank is refused, none
        changes its limit and :attr:`report` says why."""
        error = ""
        try:
            self._set(self.limits[0])
        except Exception as exc:  # NVMLError_NoPermission without admin rights, NotSupported
            error = f"{type(exc).__name__}: {exc}"
        errors = self._gather(error)
        refused = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if refused:
            self.restore()
            self.active = False
            self.report.update(
                applied=False,
                why="NVML refused to set the power limit (it needs administrator rights, like "
                "`nvidia-smi -pl`): " + "; ".join(refused),
            )
        elif not self.search:
            self.active = False
            self.report.update(applied=True, limit_w=self.limits[0])

    def _set(self, watts: float) -> None:
        self._nvml.nvmlDeviceSetPowerManagementLimit(self._handle, int(round(watts * 1000)))
        if not self._changed:
            self._changed = True
            atexit.register(self.restore)

    def step_end(self) -> None:
        """Count a step of the search (a no-op once it has chosen); collective at its end."""
        if not self.active:
            return
        self._count += 1
        if self._count == WARMUP_STEPS:
            self._sync()
            self._window = (self._read(), self._clock())
        elif self._count == WARMUP_STEPS + self._steps:
            assert self._window is not None
            self._sync()
            j0, t0 = self._window
            self._measured.append(((self._read() - j0) / self._steps, (self._clock() - t0) / self._steps))
            self._index += 1
            self._count = 0
            if self._index < len(self.limits):
                self._set(self.limits[self._index])
            else:
                self._decide()

    def _decide(self) -> None:
        everyone = self._gather((self._measured, self._max_w))
        max_power = sum(max_w for _, max_w in everyone)
        best, rows = choose_limit(
            self.limits, [m for m, _ in everyone], tradeoff=self._tradeoff, max_power_w=max_power
        )
        chosen = self.limits[best]
        self._set(chosen)
        self.active = False
        full = rows[0]
        self.report.update(
            applied=True,
            limit_w=chosen,
            tradeoff=self._tradeoff,
            steps_per_limit=self._steps,
            search_steps=len(self.limits) * (WARMUP_STEPS + self._steps),
            candidates=rows,
            energy_saved=1 - rows[best]["joules_per_step"] / full["joules_per_step"] if full["joules_per_step"] else 0.0,
            time_added=rows[best]["seconds_per_step"] / full["seconds_per_step"] - 1 if full["seconds_per_step"] else 0.0,
        )

    def restore(self) -> None:
        """Put back the limit in force before the run (idempotent; errors ignored: the GPU may
        be gone at exit)."""
        if not self._changed:
            return
        self._changed = False
        try:
            self._nvml.nvmlDeviceSetPowerManagementLimit(self._handle, self._original_mw)
        except Exception:
            pass
        atexit.unregister(self.restore)
