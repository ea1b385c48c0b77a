"""Horovod's ``hvd.elastic``: ``run``, ``TorchState``, ``ElasticSampler``, ``ObjectState``.

A worker failure restarts every worker (torch's elastic agent, ``torsh-dist horovodrun
--reset-limit K``); ``TorchState.commit()`` persists rank 0's committed state so the restarted
job resumes from it. See :mod:`torsh_distributed.compat.horovod._elastic` and docs/horovod.md.
"""

from __future__ import annotations

from typing import Any

from torsh_distributed.compat.horovod._basics import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    init,
    shutdown,
)
from torsh_distributed.compat.horovod._elastic import (
    COMMIT_DIR_ENV,
    ElasticSampler,
    ObjectState,
    State,
    TorchState,
    run,
)
from torsh_distributed.compat.horovod._unsupported import unsupported

__all__ = [
    "COMMIT_DIR_ENV",
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "init",
    "run",
    "shutdown",
]


def __getattr__(name: str) -> Any:
    raise unsupported(__name__, name)
