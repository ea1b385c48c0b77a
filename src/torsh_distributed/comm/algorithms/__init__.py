"""Collective algorithms built from point-to-point messages (ring, binomial tree, hierarchical,
bucketed). Selected through :mod:`torsh_distributed.comm.collectives` with ``algorithm=``."""

from torsh_distributed.comm.algorithms.bucketed import bucketed_all_reduce, buckets
from torsh_distributed.comm.algorithms.hierarchical import hierarchical_all_reduce
from torsh_distributed.comm.algorithms.ring import (
    ring_all_gather_,
    ring_all_reduce,
    ring_reduce_scatter_,
)
from torsh_distributed.comm.algorithms.tree import tree_all_reduce, tree_broadcast, tree_reduce
from torsh_distributed.comm.config import ALGORITHM_NAMES as ALGORITHMS

# ALGORITHMS: names accepted by ``algorithm=``; ``torch`` is the backend's own implementation.

__all__ = [
    "ALGORITHMS",
    "bucketed_all_reduce",
    "buckets",
    "hierarchical_all_reduce",
    "ring_all_gather_",
    "ring_all_reduce",
    "ring_reduce_scatter_",
    "tree_all_reduce",
    "tree_broadcast",
    "tree_reduce",
]
