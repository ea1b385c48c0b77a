"""Horovod's API on torch.distributed.

Import :mod:`torsh_distributed.compat.horovod.torch` in place of ``horovod.torch``; launch with
``torsh-dist horovodrun -np N script.py`` (or ``torsh-dist run``). The machinery lives in the
private modules of this package; docs/horovod.md maps every Horovod name to ours and lists what
is not supported.
"""

COMMIT_DIR_ENV = "TORSH_HOROVOD_ELASTIC_DIR"
"""Directory where rank 0 of an elastic job keeps its last commit across restarts (set per job by
``torsh-dist horovodrun``)."""
