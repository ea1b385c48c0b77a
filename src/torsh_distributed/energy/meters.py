"""The energy-meter protocol (the ``auto`` choice is :func:`~torsh_distributed.energy.auto.open_meter`).

A meter returns a cumulative energy in joules since it was opened; two readings give the energy
of the interval between them. Every meter says what it measures (``source``: ``measured`` from a
hardware counter, or ``estimated`` from a power model) and over what (``scope``: ``process``,
``gpu`` or ``host``): a host-scoped counter (RAPL) counts every process on the host once, so the
job's total counts it once per host, never once per rank.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["METERS", "EnergyMeter", "MeterUnavailableError"]

METERS = ("auto", "rapl", "nvml", "estimate", "off")
"""Values of ``--energy.meter``."""


class MeterUnavailableError(RuntimeError):
    """This host cannot give that meter; the message says why (no device, permission, ...)."""


@runtime_checkable
class EnergyMeter(Protocol):
    """A cumulative energy counter of this rank (see the module doc)."""

    name: str
    """``rapl``, ``nvml`` or ``estimate``."""
    source: str
    """``measured`` (a hardware counter) or ``estimated`` (a power model)."""
    scope: str
    """``process`` (this process only), ``gpu`` (one device) or ``host`` (the whole machine)."""
    scope_key: str
    """What two ranks share when they read the same counter (host name, GPU id): the job
    counts each key once."""
    detail: str
    """One line: the domains or device read, or the power model."""

    def read(self) -> float:
        """Joules since the meter was opened (monotonic; wrap-around is the meter's job)."""
        ...
