"""Per-rank energy readings during a run and the job's energy and carbon at its end.

The loop calls :meth:`EnergyTracker.step_end` after every step: it counts the step and, when
``--energy.interval`` seconds have passed, reads the meter once (one clock comparison otherwise).
:meth:`EnergyTracker.finish` reads it a last time and gathers every rank's figures (collective):

* per rank: joules, seconds, steps, average watts, grams, the meter, its source and scope;
* per job: the sum over distinct counters (a host's RAPL counted once, not once per rank),
  divided by steps, samples and tokens; grams likewise;
* by phase: :meth:`EnergyTracker.phase` reads the meter around a block of the loop (an
  evaluation, the blocking part of a checkpoint save) and attributes its joules to that phase;
  the rest of the run is ``train``.

Measured and estimated figures are never added: with ranks of both kinds the job's totals are the
measured ranks' and the estimated ranks are listed under ``excluded``.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torsh_distributed.energy.auto import open_meter
from torsh_distributed.energy.carbon import Intensity, grams_of_trace
from torsh_distributed.energy.config import CarbonConfig, EnergyConfig
from torsh_distributed.energy.meters import EnergyMeter, MeterUnavailableError
from torsh_distributed.energy.power import PowerLimit, parse_power_limit

__all__ = ["METRICS", "EnergyTracker", "all_gather_rows", "combine"]

METRICS = ("energy_joules", "energy_w", "carbon_grams")
"""Names the tracker logs after every step when given a ``log`` (the step monitor's custom
metrics: Prometheus ``torsh_energy_joules``, ``torsh_power_watts`` and ``torsh_carbon_grams``, the
dashboard's energy panel, the report): this rank's joules and grams at the latest reading and its
average watts between the last two readings."""

_TRACE_POINTS = 120
"""Readings of each rank kept for plots: the trace is halved whenever it reaches twice this, so
memory stays bounded however long the run (the carbon integral is accumulated reading by
reading, on every reading)."""


class EnergyTracker:
    """One rank's energy meter over a run (see the module doc).

    Args:
        energy: The ``energy`` section (``meter off``: every method returns at once, figures {}).
        carbon: The ``carbon`` section (the intensity is resolved once, here).
        rank: This rank.
        device: The device this rank computes on (``torch.device`` or anything with ``type``
            and ``index``); a CUDA device makes ``auto`` try NVML first, on that device.
        samples_per_step: Samples this rank counts per step (0: per-sample figures left out).
        tokens_per_step: Tokens this rank counts per step (0: per-token figures left out).
        meter: A meter to use instead of opening one (benchmarks, tests).
        clock: Wall clock of the trace (unix seconds, the series' time line).
        log: Called as ``log(name, value)`` for each of :data:`METRICS` after every step (the
            latest reading's values: no extra reading); ``None``: nothing logged.

    Raises:
        ValueError: an explicitly requested meter cannot be read on this rank (the reason).
    """

    def __init__(
        self,
        energy: EnergyConfig,
        carbon: CarbonConfig,
        *,
        rank: int = 0,
        device: Any = None,
        samples_per_step: int = 0,
        tokens_per_step: int = 0,
        meter: EnergyMeter | None = None,
        clock: Callable[[], float] = time.time,
        log: Callable[[str, float], None] | None = None,
    ) -> None:
        self.on = energy.active
        self.rank = rank
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.steps = 0
        self._clock = clock
        self._interval = energy.interval
        self._log = log
        self._watts = self.grams = self.outside = 0.0
        self._t0 = self._j0 = self._t = self._j = 0.0
        self.readings = 0
        self.times: list[float] = []
        """Unix times of the kept readings (thinned, see ``_TRACE_POINTS``)."""
        self.joules: list[float] = []
        """The meter's joules at those times."""
        self.phases: dict[str, list[float]] = {}
        """``name -> [joules, seconds, count]`` of the blocks :meth:`phase` measured."""
        self._done = False
        if not self.on:
            return
        self.intensity: Intensity = carbon.resolve()
        if meter is None:
            try:
                meter, self.why = open_meter(
                    energy.meter,
                    device_type=getattr(device, "type", "cpu"),
                    device_index=getattr(device, "index", None),
                    powercap_root=energy.powercap_root,
                    watts_per_core=energy.watts_per_core,
                )
            except MeterUnavailableError as exc:
                raise ValueError(f"energy.meter {energy.meter}: unavailable on rank {rank}: {exc}") from None
        else:
            self.why = "given"
        self.meter = meter
        self._next = -math.inf
        self.power = _power_limit(energy, meter, rank=rank, device=device)

    def _start_power(self) -> None:
        if self.power is not None:
            self.power.start()  # collective: every rank sets its first limit, or none does

    def start(self) -> None:
        """The first reading (call just before the first step); on rank 0, a warning when the
        intensity series does not reach the present (its edge value would hold)."""
        if not self.on:
            return
        self._start_power()
        now = self._clock()
        self._sample(now)
        ends = getattr(self.intensity, "ends", None)
        if self.rank == 0 and ends and not ends[-1] > now:
            warnings.warn(
                f"carbon.series {self.intensity.detail}: its last slot ends "
                f"{(now - ends[-1]) / 3600:.1f} h before the run starts; its last value "
                f"({self.intensity.at(now):g} g/kWh) holds for the whole run",
                stacklevel=2,
            )

    def _sample(self, now: float) -> None:
        joules = self.meter.read()
        self._next = time.monotonic() + self._interval
        if self.readings:
            grams, outside = grams_of_trace([self._t, now], [self._j, joules], self.intensity)
            self.grams += grams
            self.outside += outside
            if now > self._t:
                self._watts = (joules - self._j) / (now - self._t)
        else:
            self._t0, self._j0 = now, joules
        self._t, self._j = now, joules
        self.readings += 1
        if len(self.times) >= 2 * _TRACE_POINTS:  # keep the first, every other, and the latest
            self.times, self.joules = self.times[::2], self.joules[::2]
        self.times.append(now)
        self.joules.append(joules)

    def step_end(self) -> None:
        """Count a step; read the meter when the interval has passed (the hot path)."""
        if not self.on:
            return
        self.steps += 1
        if self.power is not None and self.power.active:
            self.power.step_end()  # the search's windows (collective at its end)
        if time.monotonic() >= self._next:
            self._sample(self._clock())
        if self._log is not None:
            self._log("energy_joules", self._j - self._j0)
            self._log("energy_w", self._watts)
            self._log("carbon_grams", self.grams)

    def reading(self) -> None:
        """Read the meter now (a trace point), whatever the interval: at the edges of a carbon
        pause, so the energy of the steps before it is priced at their own time's intensity
        rather than spread over the pause. A no-op when off, before :meth:`start` and after
        :meth:`finish`."""
        if self.on and self.readings and not self._done:
            self._sample(self._clock())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the meter's joules over the block to phase ``name`` (two readings, no trace
        point); a no-op when off, before :meth:`start` and after :meth:`finish`."""
        if not self.on or not self.readings or self._done:
            yield
            return
        j0, t0 = self.meter.read(), time.monotonic()
        try:
            yield
        finally:
            totals = self.phases.setdefault(name, [0.0, 0.0, 0])
            totals[0] += self.meter.read() - j0
            totals[1] += time.monotonic() - t0
            totals[2] += 1

    def row(self) -> dict[str, Any]:
        """This rank's figures, after a last reading."""
        self._done = True  # later blocks (the final evaluation and save) are not metered
        if not self.on or not self.readings:
            return {}
        if self.steps and self._clock() > self._t:
            self._sample(self._clock())
        joules, seconds = self._j - self._j0, self._t - self._t0
        m = self.meter
        power: dict[str, Any] = {}
        if self.power is not None:
            self.power.restore()
            power = {"power_limit": self.power.report}
        return {
            **power,
            "rank": self.rank,
            "meter": m.name,
            "source": m.source,
            "scope": m.scope,
            "scope_key": m.scope_key if m.scope != "process" else f"rank{self.rank}",
            "detail": m.detail,
            "why": self.why,
            "joules": joules,
            "seconds": seconds,
            "average_power_w": joules / seconds if seconds > 0 else 0.0,
            "steps": self.steps,
            "samples": self.samples_per_step * self.steps,
            "tokens": self.tokens_per_step * self.steps,
            "readings": self.readings,
            "grams": self.grams,
            "seconds_outside_series": self.outside,
            "trace": [[t - self._t0, j - self._j0] for t, j in zip(self.times, self.joules, strict=True)],
            "trace_start_unix_s": self._t0,
            "phases": {n: {"joules": j, "seconds": s, "count": int(c)} for n, (j, s, c) in self.phases.items()},
        }

    def finish(
        self, gather: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The job's ``energy`` and ``carbon`` blocks (collective in a multi-rank process group:
        every rank calls it). ``gather`` maps this rank's row to every rank's, in rank order;
        default: :func:`all_gather_rows`."""
        if not self.on:
            return {}, {}
        rows = (gather or all_gather_rows)(self.row())
        return combine([r for r in rows if r], self.intensity)


def _power_limit(energy: EnergyConfig, meter: EnergyMeter, *, rank: int, device: Any) -> PowerLimit | None:
    """The rank's power-limit control (``--energy.power-limit``), or ``None`` when off."""
    limit = parse_power_limit(energy.power_limit)
    if limit is None:
        return None
    nvml, handle = getattr(meter, "nvml", None), getattr(meter, "handle", None)
    if nvml is None or handle is None:
        raise ValueError(
            f"energy.power_limit {energy.power_limit!r} needs the NVML meter of a CUDA rank; rank {rank} "
            f"meters with {meter.name} ({meter.detail})"
        )

    def sync() -> None:
        import torch

        if getattr(device, "type", "cpu") == "cuda":
            torch.cuda.synchronize(device)

    return PowerLimit(
        nvml, handle, meter.read, limit_w=limit, tradeoff=energy.power_tradeoff, steps=energy.power_steps,
        stride_w=energy.power_stride_w, clock=time.monotonic, sync=sync,
    )


def all_gather_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``row`` on the default process group (``[row]`` without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [row]
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def combine(rows: list[dict[str, Any]], intensity: Intensity) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's blocks from every rank's row (see the module doc)."""
    if not rows:
        return {}, {}
    measured = [r for r in rows if r["source"] == "measured"]
    counted = measured or rows
    excluded = [r["rank"] for r in rows if r not in counted]
    seen: dict[str, dict[str, Any]] = {}
    for r in counted:  # one figure per counter: a host's RAPL read by 4 ranks counts once
        key = f"{r['scope']}:{r['scope_key']}"
        if key not in seen or r["joules"] > seen[key]["joules"]:
            seen[key] = r
    joules = sum(r["joules"] for r in seen.values())
    grams = sum(r["grams"] for r in seen.values())
    steps = max(r["steps"] for r in rows)
    samples = sum(r["samples"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    seconds = max(r["seconds"] for r in rows)
    meters = sorted({r["meter"] for r in counted})
    power = rows[0].get("power_limit")  # one decision for every rank
    energy: dict[str, Any] = {
        "joules": joules,
        "joules_per_step": joules / steps if steps else 0.0,
        "joules_per_sample": joules / samples if samples else None,
        "joules_per_token": joules / tokens if tokens else None,
        "average_power_w": joules / seconds if seconds > 0 else 0.0,
        "source": counted[0]["source"],
        "meter": meters[0] if len(meters) == 1 else "+".join(meters),
        "why": counted[0]["why"],
        "detail": counted[0]["detail"],
        "counters": len(seen),
        "steps": steps,
        "seconds": seconds,
        "ranks": [{k: v for k, v in r.items() if k not in ("why", "detail", "power_limit")} for r in rows],
    }
    if power is not None:
        energy["power_limit"] = power
    names = sorted({n for r in seen.values() for n in r.get("phases", {})})
    if names:  # the counted rows' phases; the rest of the run is training
        phases = {n: sum(r.get("phases", {}).get(n, {}).get("joules", 0.0) for r in seen.values()) for n in names}
        energy["phases"] = {"train": joules - sum(phases.values()), **phases}
    if not tokens:
        energy.pop("joules_per_token")
    if not samples:
        energy.pop("joules_per_sample")
    if excluded:
        energy["excluded"] = {
            "ranks": excluded,
            "estimated_joules": sum(r["joules"] for r in rows if r["rank"] in excluded),
            "why": "estimated figures are never added to measured ones",
        }
    kwh = joules / 3.6e6
    carbon: dict[str, Any] = {
        "grams": grams,
        "intensity_source": intensity.source,
        "intensity_detail": intensity.detail,
        "intensity_g_per_kwh": grams / kwh if kwh > 0 else intensity.at(time.time()),
        "seconds_outside_series": max(r["seconds_outside_series"] for r in counted),
        "ranks": [{"rank": r["rank"], "grams": r["grams"]} for r in rows],
    }
    return energy, carbon
