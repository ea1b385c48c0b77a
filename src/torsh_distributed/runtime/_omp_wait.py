"""Imported first by a process that is about to import torch (the ``torsh-dist`` command, a
forkserver's preload): decides whether GNU OpenMP's idle threads spin or sleep.

torch's CPU kernels run on an OpenMP team (every usable core by default; the engine's default
for a one-process job). Between parallel regions GNU OpenMP's threads spin before they sleep,
which is fastest when each has a core of its own and ruinous on a busy host: a spinning thread
burns the time slice its teammate, descheduled by a neighbour, needs to reach the next barrier.
``OMP_WAIT_POLICY=PASSIVE`` makes them sleep at once. Measured side by side
(``benchmarks/bench_omp_wait.py``, docs/benchmarks.md, "OpenMP's wait policy"): beside one
CPU-burning process per core, sleeping threads made a one-process training run 7x and greedy
decoding 10x faster; quiet, they cost 8-19 % and 28 %. So the policy follows the host at start
(:func:`torsh_distributed.runtime.busy.sleeping_openmp_waits`): PASSIVE when the threads ready
to run besides this process leave no core for a team of every usable core, GNU OpenMP's
spinning default otherwise; the decision and its reason go to ``TORSH_OMP_WAIT``.

OpenMP reads the variable once, when torch loads it, so this must run before ``import torch``
(the stdlib's forkserver takes module names to preload: this is a module, put first). A value
the user set (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``) is theirs and is kept, and a decision
inherited from the process that started this one stands. Processes started from this one
inherit the setting, as with any exported variable.
"""

from __future__ import annotations

from torsh_distributed.runtime.busy import sleeping_openmp_waits

__all__: list[str] = []

sleeping_openmp_waits()
