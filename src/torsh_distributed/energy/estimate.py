"""An energy estimate from this process's CPU time where no hardware counter is readable.

``joules = CPU seconds of this process (all its threads) x watts per busy core``. The default
4 W per busy core (hardware thread) is CodeCarbon's fallback power per thread for a CPU it does
not know (``DEFAULT_POWER_PER_CORE = 4`` in ``codecarbon/core/cpu.py``, MIT licence): a core
kept busy for a second is counted at its share of a typical TDP. Idle power, memory, disks,
network and accelerators are not counted. Always labelled ``estimated``; set
``--energy.watts-per-core`` from your CPU's TDP / hardware threads when you know it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["DEFAULT_WATTS_PER_CORE", "CpuTimeEstimate"]

DEFAULT_WATTS_PER_CORE = 4.0
"""CodeCarbon's default power per CPU thread when the CPU model is unknown (see module doc)."""


class CpuTimeEstimate:
    """Estimated joules of this process: its CPU seconds times ``watts_per_core``.

    Args:
        watts_per_core: Power of one fully busy core (hardware thread), in watts.
        cpu_seconds: The clock of this process's CPU time (``time.process_time``: user + system
            of every thread); tests pass their own.
    """

    name = "estimate"
    source = "estimated"
    scope = "process"

    def __init__(
        self,
        *,
        watts_per_core: float = DEFAULT_WATTS_PER_CORE,
        cpu_seconds: Callable[[], float] = time.process_time,
    ) -> None:
        if not watts_per_core > 0:
            raise ValueError(f"watts_per_core must be > 0, got {watts_per_core}")
        self.watts_per_core = watts_per_core
        self._cpu_seconds = cpu_seconds
        self._start = cpu_seconds()
        self.scope_key = f"pid{os.getpid()}"
        self.detail = f"CPU time of this process x {watts_per_core:g} W per busy core"

    def read(self) -> float:
        """Estimated joules since the meter opened."""
        return (self._cpu_seconds() - self._start) * self.watts_per_core
