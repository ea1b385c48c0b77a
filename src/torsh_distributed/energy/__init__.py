"""Energy and carbon of a training run (see docs/energy.md).

Meters behind one :class:`EnergyMeter` protocol (RAPL through powercap, NVML, and an estimate
from CPU time where neither is readable), an :class:`EnergyTracker` the loop calls once per step,
carbon from a constant, a region's annual average or an intensity time series, and carbon-aware
time shifting (:class:`TimeShift`: pause while the series is above a threshold) and scaling
(:class:`ScalePolicy`, :class:`CarbonScale`: more workers while the series is clean).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.energy.auto import open_meter
    from torsh_distributed.energy.carbon import (
        ConstantIntensity,
        IntensitySeries,
        grams_of_trace,
        load_series,
        region_intensity,
    )
    from torsh_distributed.energy.config import CarbonConfig, EnergyConfig
    from torsh_distributed.energy.estimate import CpuTimeEstimate
    from torsh_distributed.energy.meters import METERS, EnergyMeter, MeterUnavailableError
    from torsh_distributed.energy.nvml import NvmlMeter
    from torsh_distributed.energy.rapl import RaplMeter
    from torsh_distributed.energy.scale import CarbonScale, ScalePolicy, scaling_summary
    from torsh_distributed.energy.shift import ShiftPolicy, TimeShift, parse_deadline
    from torsh_distributed.energy.tracker import EnergyTracker, combine


__all__ = [
    "METERS",
    "CarbonConfig",
    "CarbonScale",
    "ConstantIntensity",
    "CpuTimeEstimate",
    "EnergyConfig",
    "EnergyMeter",
    "EnergyTracker",
    "IntensitySeries",
    "MeterUnavailableError",
    "NvmlMeter",
    "RaplMeter",
    "ScalePolicy",
    "ShiftPolicy",
    "TimeShift",
    "combine",
    "grams_of_trace",
    "load_series",
    "open_meter",
    "parse_deadline",
    "region_intensity",
    "scaling_summary",
]

# On first use: the meters, tracker and carbon series are for the ranks; the CLI needs
# energy.config.
__getattr__, __dir__ = exports(
    __name__,
    {
        "auto": ("open_meter",),
        "carbon": (
            "ConstantIntensity", "IntensitySeries", "grams_of_trace", "load_series",
            "region_intensity",
        ),
        "config": ("CarbonConfig", "EnergyConfig"),
        "estimate": ("CpuTimeEstimate",),
        "meters": ("METERS", "EnergyMeter", "MeterUnavailableError"),
        "nvml": ("NvmlMeter",),
        "rapl": ("RaplMeter",),
        "scale": ("CarbonScale", "ScalePolicy", "scaling_summary"),
        "shift": ("ShiftPolicy", "TimeShift", "parse_deadline"),
        "tracker": ("EnergyTracker", "combine"),
    },
)
