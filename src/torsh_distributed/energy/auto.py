"""Open the meter ``--energy.meter`` names; ``auto``: NVML, else RAPL, else the estimate."""

from __future__ import annotations

from torsh_distributed.energy.estimate import CpuTimeEstimate
from torsh_distributed.energy.meters import METERS, EnergyMeter, MeterUnavailableError
from torsh_distributed.energy.nvml import NvmlMeter
from torsh_distributed.energy.rapl import RaplMeter

__all__ = ["open_meter"]


def open_meter(
    kind: str,
    *,
    device_type: str = "cpu",
    device_index: int | None = None,
    powercap_root: str = "/sys/class/powercap",
    watts_per_core: float = 4.0,
) -> tuple[EnergyMeter, str]:
    """The meter ``kind`` names, or for ``auto`` the best this rank has, and why it was chosen.

    ``auto`` takes NVML when this rank computes on a CUDA device, else RAPL when its counters
    are readable, else the CPU-time estimate; the reason names what was missing.

    Raises:
        ValueError: ``kind`` is not one of :data:`METERS` or is ``off``.
        MeterUnavailableError: an explicitly requested meter cannot be read here.
    """
    if kind not in METERS or kind == "off":
        raise ValueError(f"energy.meter must be one of {', '.join(METERS[:-1])} to open, got {kind!r}")
    if kind == "nvml":
        return NvmlMeter(device_index or 0), "requested (--energy.meter nvml)"
    if kind == "rapl":
        return RaplMeter(powercap_root), "requested (--energy.meter rapl)"
    if kind == "estimate":
        return CpuTimeEstimate(watts_per_core=watts_per_core), "requested (--energy.meter estimate)"
    missing: list[str] = []
    if device_type == "cuda":
        try:
            return NvmlMeter(device_index or 0), "auto: this rank computes on a CUDA device"
        except MeterUnavailableError as exc:
            missing.append(f"nvml: {exc}")
    else:
        missing.append("nvml: this rank computes on the CPU")
    try:
        return RaplMeter(powercap_root), "auto: " + "; ".join(missing + ["rapl readable"])
    except MeterUnavailableError as exc:
        missing.append(f"rapl: {exc}")
    estimate = CpuTimeEstimate(watts_per_core=watts_per_core)
    return estimate, "auto: no hardware counter (" + "; ".join(missing) + ")"
