"""How busy this host is, for start-up deadlines that a loaded machine must not break.

A start-up deadline (processes importing Python and torch, a server opening its port) counts
seconds of wall time, but the work behind it is CPU time shared with everything else that runs:
at a 1-minute load of 20 on 2 usable cores a start takes about 10 times as long as on the same
machine when it is quiet. :func:`scaled_start_timeout` stretches a *default* deadline by that
factor (never shrinks it); a deadline the user set is theirs and is never changed.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["busy_factor", "scaled_start_timeout", "sleeping_openmp_waits", "usable_cores"]

MAX_FACTOR = 10.0
"""A hung process must still be found: the stretch stops at 10 times the quiet deadline."""


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def busy_factor() -> float:
    """Runnable tasks per usable core over the last minute, between 1 (quiet) and
    :data:`MAX_FACTOR`; 1 where the load average cannot be read."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(MAX_FACTOR, max(1.0, load / usable_cores()))


def scaled_start_timeout(default_s: float) -> float:
    """``default_s`` stretched by :func:`busy_factor`: the default deadline of a start-up."""
    return default_s * busy_factor()


OMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""What decides how GNU OpenMP's idle threads wait; a user who set either keeps their choice."""


def sleeping_openmp_waits(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (this process's environment by default)
    unless the user set how OpenMP waits; True when it was set here.

    Idle OpenMP threads then sleep instead of spinning, so a busy host's neighbours do not turn
    torch's thread team into a spin-wait (``torsh_distributed.runtime._omp_wait``). It takes
    effect in a process that imports torch afterwards: this one, if it has not yet, and every
    process started from it."""
    env = os.environ if environ is None else environ
    if any(name in env for name in OMP_WAIT_VARIABLES):
        return False
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
