"""Imported first by a process that is about to import torch (the ``torsh-dist`` command, a
forkserver's preload): GNU OpenMP's idle threads sleep instead of spinning.

torch's CPU kernels run on an OpenMP team (every usable core by default; the engine's default
for a one-process job). Between parallel regions GNU OpenMP's threads spin before they sleep,
which costs nothing when each has a core of its own and a great deal on a busy host: a spinning
thread burns the time slice its teammate, descheduled by a neighbour, needs to reach the next
barrier. ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep at once. Measured side by side
(``benchmarks/bench_omp_wait.py``, docs/benchmarks.md, "OpenMP's wait policy"): beside one
CPU-burning process per core a one-process training run is several times faster and uses a
fraction of the CPU; quiet, the two policies are within noise.

OpenMP reads the variable once, when torch loads it, so this must run before ``import torch``
(the stdlib's forkserver takes module names to preload: this is a module, put first). A value
the user set (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``) is theirs and is kept. Processes started
from this one inherit the setting, as with any exported variable.
"""

from __future__ import annotations

from torsh_distributed.runtime.busy import sleeping_openmp_waits

__all__: list[str] = []

sleeping_openmp_waits()
