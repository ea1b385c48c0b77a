"""How busy this host is, for start-up deadlines that a loaded machine must not break.

A start-up deadline (processes importing Python and torch, a server opening its port) counts
seconds of wall time, but the work behind it is CPU time shared with everything else that runs:
at a 1-minute load of 20 on 2 usable cores a start takes about 10 times as long as on the same
machine when it is quiet. :func:`scaled_start_timeout` stretches a *default* deadline by that
factor (never shrinks it); a deadline the user set is theirs and is never changed.

How torch's OpenMP threads wait follows the host too: :func:`sleeping_openmp_waits` makes them
sleep instead of spin when the host is busy at start (``runtime/_omp_wait.py``).
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

OMP_WAIT_DECISION = "TORSH_OMP_WAIT"
"""Where :func:`sleeping_openmp_waits` writes what it decided and why (one line), for the
processes started from this one and for anyone asking why a run spun or slept."""


def runnable_besides_me(samples: int = 3, interval_s: float = 0.005) -> float | None:
    """Threads ready to run on this host besides the caller, the mean of ``samples`` reads of
    ``procs_running`` in ``/proc/stat`` (``None`` where it cannot be read). A CPU-bound
    neighbour is always runnable, so it is counted at every read."""
    import time

    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                line = next((x for x in f if x.startswith("procs_running ")), "")
        except OSError:
            return None
        if not line:
            return None
        counts.append(max(0, int(line.split()[1]) - 1))  # the caller is running while it reads
        if i + 1 < samples:
            time.sleep(interval_s)
    return sum(counts) / len(counts)


def sleeping_openmp_waits(
    environ: MutableMapping[str, str] | None = None, *, runnable: float | None = -1.0
) -> bool:
    """Decide how OpenMP's idle threads wait in the processes about to import torch: set
    ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (this process's environment by default) when the
    host is busy, that is when the threads ready to run besides this process (``runnable``;
    default: :func:`runnable_besides_me`) and a team of every usable core would not fit on the
    host's cores; leave GNU OpenMP's spinning default on a quiet host, and leave the choice of a
    user who set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``. Writes the decision and its reason to
    ``environ[TORSH_OMP_WAIT]`` either way; where that is already set, the process that started
    this one decided and nothing changes. True when PASSIVE was set here.

    Spinning threads are fastest on cores of their own and ruinous beside a neighbour, sleeping
    ones the reverse (measured: docs/benchmarks.md, "OpenMP's wait policy"); the decision takes
    what can be known at start. It takes effect in a process that imports torch afterwards: this
    one, if it has not yet, and every process started from it."""
    env = os.environ if environ is None else environ
    if OMP_WAIT_DECISION in env:  # decided by the process that started this one: inherited as is
        return False
    chosen = [f"{name}={env[name]}" for name in OMP_WAIT_VARIABLES if name in env]
    if chosen:
        env[OMP_WAIT_DECISION] = f"kept: {', '.join(chosen)} set by the user"
        return False
    if runnable is not None and runnable < 0:
        runnable = runnable_besides_me()
    cores, team = os.cpu_count() or 1, usable_cores()
    if runnable is None:
        busy, why = True, "the host's runnable threads cannot be read (/proc/stat)"
    else:
        busy = runnable + team > cores + 0.5  # a neighbour ready at most reads, not one in passing
        why = (
            f"{runnable:g} thread(s) ready to run besides this process and a team of {team} on "
            f"{cores} core(s)"
        )
    if busy:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    env[OMP_WAIT_DECISION] = f"{'PASSIVE (busy)' if busy else 'spin (quiet)'}: {why}"
    return busy
