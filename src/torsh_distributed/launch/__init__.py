"""Cluster launchers beyond ``torsh-dist run``: SLURM, Open MPI, Ray and Dask.

Each one only starts the processes and derives the rendezvous (rank, world size, master address
and port) from what the scheduler already knows; torch.distributed (Gloo on CPU, NCCL on GPU) does
the rest, as under ``torsh-dist run``.

* :func:`slurm_script` writes an ``sbatch`` script for N nodes x G processes
  (``torsh-dist slurm``); under ``srun`` ranks come from ``SLURM_*`` variables.
* Under ``mpirun -np N`` ranks come from ``OMPI_COMM_WORLD_*`` (see
  :mod:`torsh_distributed.runtime.env`).
* :func:`ray` and :func:`dask` run a Python training function on N workers of a Ray cluster or a
  Dask cluster and return every rank's result.

Imported lazily: ``import torsh_distributed.launch`` pulls in neither Ray nor Dask.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["dask", "ray", "slurm_script"]

_WHERE = {
    "ray": "torsh_distributed.launch.ray_cluster",
    "dask": "torsh_distributed.launch.dask_cluster",
    "slurm_script": "torsh_distributed.launch.slurm",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
