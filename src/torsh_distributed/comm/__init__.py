"""Communication: the collectives facade, ParallelDims (meshes and groups), algorithms, cost
model, hang/mismatch diagnosis and the collective profiler. See docs/communication.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.comm import collectives, debug, profiler
    from torsh_distributed.comm.collectives import Work
    from torsh_distributed.comm.cost_model import CostModel, Decision, LinkCost
    from torsh_distributed.comm.debug import CollectiveHangError, CollectiveMismatchError
    from torsh_distributed.comm.dims import ParallelDims, current_dims
    from torsh_distributed.comm.reduce_op import ReduceOp

__all__ = [
    "CollectiveHangError",
    "CollectiveMismatchError",
    "CostModel",
    "Decision",
    "LinkCost",
    "ParallelDims",
    "ReduceOp",
    "Work",
    "collectives",
    "current_dims",
    "debug",
    "profiler",
]

# On first use: the facade imports torch, the trainer's config needs only comm.config.
__getattr__, __dir__ = exports(
    __name__,
    {
        "collectives": ("Work",),
        "cost_model": ("CostModel", "Decision", "LinkCost"),
        "debug": ("CollectiveHangError", "CollectiveMismatchError"),
        "dims": ("ParallelDims", "current_dims"),
        "reduce_op": ("ReduceOp",),
    },
    submodules=("collectives", "debug", "profiler"),
)
