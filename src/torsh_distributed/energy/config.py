"""The ``energy`` and ``carbon`` config sections (torch-free)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torsh_distributed.energy.estimate import DEFAULT_WATTS_PER_CORE
from torsh_distributed.energy.meters import METERS
from torsh_distributed.energy.power import parse_power_limit

if TYPE_CHECKING:
    from torsh_distributed.energy.carbon import Intensity
    from torsh_distributed.energy.scale import ScalePolicy
    from torsh_distributed.energy.shift import ShiftPolicy

__all__ = ["CarbonConfig", "EnergyConfig"]


@dataclass(kw_only=True, slots=True)
class EnergyConfig:
    """Energy metering of every rank (on by default: it only reads a counter)."""

    meter: str = field(default="auto", metadata={"flags": []})
    """``auto`` (NVML on a CUDA rank, else RAPL when readable, else the estimate), ``rapl``,
    ``nvml``, ``estimate`` (CPU time x --energy.watts-per-core, labelled estimated) or ``off``.
    A requested meter this host lacks fails before training with the reason."""
    interval: float = field(default=1.0, metadata={"flags": []})
    """Seconds between two readings of the counter (checked once per step): the resolution of
    the energy trace the carbon integral uses. RAPL needs one reading per wrap period (minutes)."""
    watts_per_core: float = field(default=DEFAULT_WATTS_PER_CORE, metadata={"flags": []})
    """The estimate's power of one busy core (hardware thread), in watts; default 4 W,
    CodeCarbon's fallback per thread (docs/energy.md)."""
    powercap_root: str = field(default="/sys/class/powercap", metadata={"flags": []})
    """Where RAPL's powercap tree is (another path when sysfs is mounted elsewhere)."""
    power_limit: str = field(default="off", metadata={"flags": []})
    """GPU power limit of every CUDA rank through NVML: ``off`` (the GPU's own), a limit in
    watts (``300``), or ``search``: Zeus-style profiling of the job's first steps at each limit,
    then the limit with the least cost (--energy.power-tradeoff); the old limit is restored at
    the end. Needs the NVML meter and, on most hosts, administrator rights (refused: reported,
    nothing changed)."""
    power_tradeoff: float = field(default=0.5, metadata={"flags": []})
    """The search's weight of energy against time, in [0, 1]: cost = eta J/step + (1 - eta)
    max-power s/step (1: energy only, 0: time only; Zeus's default 0.5)."""
    power_steps: int = field(default=10, metadata={"flags": []})
    """Steps measured at each limit of the search (after 2 warm-up steps per limit)."""
    power_stride_w: float = field(default=50.0, metadata={"flags": []})
    """Watts between two limits of the search (from the GPU's largest down to its smallest):
    smaller finds a better limit, with more search steps."""

    def __post_init__(self) -> None:
        if self.meter not in METERS:
            raise ValueError(f"energy.meter must be one of {', '.join(METERS)}, got {self.meter!r}")
        if not (math.isfinite(self.interval) and self.interval > 0):
            raise ValueError(f"energy.interval must be > 0 seconds, got {self.interval}")
        if not (math.isfinite(self.watts_per_core) and self.watts_per_core > 0):
            raise ValueError(f"energy.watts_per_core must be > 0 W, got {self.watts_per_core}")
        limit = parse_power_limit(self.power_limit)
        if limit is not None and self.meter not in ("auto", "nvml"):
            raise ValueError(
                f"energy.power_limit {self.power_limit!r} sets GPU limits through NVML: use "
                f"--energy.meter nvml or auto, not {self.meter!r}"
            )
        if not (math.isfinite(self.power_tradeoff) and 0 <= self.power_tradeoff <= 1):
            raise ValueError(f"energy.power_tradeoff must be in [0, 1], got {self.power_tradeoff}")
        if self.power_steps < 1:
            raise ValueError(f"energy.power_steps must be >= 1, got {self.power_steps}")
        if not (math.isfinite(self.power_stride_w) and self.power_stride_w > 0):
            raise ValueError(f"energy.power_stride_w must be > 0 W, got {self.power_stride_w}")

    @property
    def active(self) -> bool:
        return self.meter != "off"


@dataclass(kw_only=True, slots=True)
class CarbonConfig:
    """Grid carbon intensity for the run's emissions (grams CO2e = kWh x gCO2e/kWh).

    At most one of ``intensity``, ``series`` and ``region``; with none, the world average
    (475 g/kWh, labelled ``default``)."""

    intensity: float = field(default=0.0, metadata={"flags": []})
    """A constant intensity in gCO2e/kWh (0 = not given)."""
    series: str = field(default="", metadata={"flags": []})
    """A time series of the intensity: CSV (timestamp, gCO2/kWh), Electricity Maps history JSON
    or the UK carbon-intensity API's JSON; checked before training (docs/energy.md)."""
    region: str = field(default="", metadata={"flags": []})
    """A country's annual average from the shipped table (ISO alpha-3: DEU, FRA, USA, ...)."""
    max_intensity: float = field(default=0.0, metadata={"flags": []})
    """Time shifting (needs --carbon.series): while the series' intensity is above this many
    gCO2/kWh the job checkpoints (with --checkpoint.dir) and pauses until the first slot at or
    below it. Outside the series the job runs. 0 = off."""
    deadline: str = field(default="", metadata={"flags": []})
    """Bound of time shifting: an ISO 8601 time (no zone = UTC) or a duration from the first
    step (30m, 90s, 1h30m); no pause that would end training after it, by the measured step
    time. Empty = pauses are unbounded."""
    scale: bool = field(default=False, metadata={"flags": [], "negatable": True})
    """Carbon-aware scaling (needs --carbon.series, --checkpoint.dir and --nproc-per-node
    MIN:MAX): MAX workers in the series' cleanest slot, MIN in its dirtiest, linear in between;
    at a change the job checkpoints and restarts at the new size, if the new size holds longer
    than a restart takes. Not with --carbon.max-intensity."""
    refresh: float = field(default=60.0, metadata={"flags": []})
    """Seconds: while time shifting or scaling, --carbon.series is read again when the file
    changes (a forecast another job refreshes: write the new file, then rename it over the old
    one), looked at at least this often; a change that does not parse is reported and the old
    series kept. 0 = read once."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.intensity) or self.intensity < 0:
            raise ValueError(f"carbon.intensity must be >= 0 gCO2/kWh (0 = not given), got {self.intensity}")
        given = [n for n, v in (("intensity", self.intensity), ("series", self.series),
                                ("region", self.region)) if v]
        if len(given) > 1:
            raise ValueError(f"give one of --carbon.intensity, --carbon.series, --carbon.region, got {given}")
        if not math.isfinite(self.max_intensity) or self.max_intensity < 0:
            raise ValueError(f"carbon.max_intensity must be >= 0 gCO2/kWh (0 = off), got {self.max_intensity}")
        if self.max_intensity and not self.series:
            raise ValueError(
                f"carbon.max_intensity {self.max_intensity:g} needs --carbon.series FILE: time shifting "
                "follows the intensity over time (a constant or a region's average never changes)"
            )
        if self.deadline and not self.max_intensity:
            raise ValueError(
                f"carbon.deadline {self.deadline!r} bounds time shifting: give --carbon.max-intensity X "
                "with it (without it the job never pauses)"
            )
        if not math.isfinite(self.refresh) or self.refresh < 0:
            raise ValueError(f"carbon.refresh must be >= 0 seconds (0 = read the series once), got {self.refresh}")
        if self.scale and not self.series:
            raise ValueError(
                "carbon.scale needs --carbon.series FILE: scaling follows the intensity over time "
                "(a constant or a region's average never changes)"
            )
        if self.scale and self.max_intensity:
            raise ValueError(
                "carbon.scale with carbon.max_intensity is not built: choose scaling (--carbon.scale) "
                "or time shifting (--carbon.max-intensity)"
            )
        intensity = self.resolve()  # a bad series or region fails here, before any rank starts
        if self.max_intensity:
            # parses the deadline; whether the series and the deadline still lie ahead is checked
            # when a run starts (a resumed run after them runs on: see TimeShift)
            self.shift_policy(intensity)

    def shift_policy(self, intensity: Intensity | None = None, *, start: float | None = None) -> ShiftPolicy:
        """The time-shifting policy of these settings (a duration deadline counts from
        ``start``, default now).

        Raises:
            ValueError: time shifting is off, or the deadline is not a time or a duration.
        """
        from torsh_distributed.energy.carbon import IntensitySeries
        from torsh_distributed.energy.shift import ShiftPolicy, parse_deadline

        series = self.resolve() if intensity is None else intensity
        if not self.max_intensity or not isinstance(series, IntensitySeries):
            raise ValueError("carbon: time shifting needs --carbon.max-intensity and --carbon.series")
        deadline = None
        if self.deadline:
            kind, value = parse_deadline(self.deadline)
            deadline = (time.time() if start is None else start) + value if kind == "after" else value
        return ShiftPolicy(series, self.max_intensity, deadline)

    def scale_policy(self, sizes: Sequence[int], intensity: Intensity | None = None) -> ScalePolicy:
        """The scaling policy of these settings over the world sizes ``sizes`` (at least two).

        Raises:
            ValueError: no series, or fewer than two sizes.
        """
        from torsh_distributed.energy.carbon import IntensitySeries
        from torsh_distributed.energy.scale import ScalePolicy

        series = self.resolve() if intensity is None else intensity
        if not isinstance(series, IntensitySeries):
            raise ValueError("carbon: scaling needs --carbon.series")
        return ScalePolicy(series, min(sizes), max(sizes), tuple(sizes))

    def resolve(self) -> Intensity:
        """The intensity these settings name (parses the series file)."""
        from torsh_distributed.energy.carbon import ConstantIntensity, load_series, region_intensity

        if self.intensity:
            return ConstantIntensity(self.intensity, detail=f"{self.intensity:g} g/kWh (--carbon.intensity)")
        if self.series:
            return load_series(self.series)
        return region_intensity(self.region)
