"""Communication: the collectives facade, ParallelDims (meshes and groups), algorithms, cost
model, hang/mismatch diagnosis and the collective profiler. See docs/communication.md."""

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
