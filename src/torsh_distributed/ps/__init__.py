"""A sharded parameter server over RPC: dense keys hashed to servers, embedding rows by row id,
a server-side optimizer, synchronous / bounded-staleness / asynchronous consistency, atomic shard
snapshots with restore, and a training loop for any model (:mod:`torsh_distributed.ps.train`).

See docs/parameter-server.md. torch.distributed.rpc pickles its messages: every peer must trust
every other; servers listen on loopback unless told otherwise (and then require a token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.ps._shard import TableSpec
    from torsh_distributed.ps.client import PSClient, PullResult, Rows
    from torsh_distributed.ps.config import PSConfig, ServerOptimConfig
    from torsh_distributed.ps.server import ParameterShard, serve_forever
    from torsh_distributed.ps.train import PSTrainConfig, format_summary, run

__all__ = [
    "PSConfig",
    "ServerOptimConfig",
    "TableSpec",
    "Rows",
    "PullResult",
    "PSClient",
    "ParameterShard",
    "serve_forever",
    "PSTrainConfig",
    "run",
    "format_summary",
]

# On first use: the server and client import torch; torsh-dist train needs only ps.config.
__getattr__, __dir__ = exports(
    __name__,
    {
        "_shard": ("TableSpec",),
        "client": ("PSClient", "PullResult", "Rows"),
        "config": ("PSConfig", "ServerOptimConfig"),
        "server": ("ParameterShard", "serve_forever"),
        "train": ("PSTrainConfig", "format_summary", "run"),
    },
)
