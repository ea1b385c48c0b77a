"""Horovod's names under ``torsh_distributed``: change only the import lines of a Horovod script.

* ``import torsh_distributed.horovod.torch as hvd`` is
  :mod:`torsh_distributed.compat.horovod.torch` (the name used in issue #19);
* ``import torsh_distributed.horovod as horovod`` gives :func:`run`, Horovod's programmatic
  launcher ``horovod.run(func, args=(), kwargs=None, num_proc=N, ...)``, which returns every
  rank's return value (docs/horovod.md).
"""

from __future__ import annotations

from torsh_distributed.compat.horovod._launch import run

__all__ = ["run"]
