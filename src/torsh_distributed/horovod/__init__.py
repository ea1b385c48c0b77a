"""Alias package: ``import torsh_distributed.horovod.torch as hvd`` is
:mod:`torsh_distributed.compat.horovod.torch` (the name used in issue #19)."""
