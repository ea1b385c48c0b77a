"""``gloo+shm``: a CPU process-group backend with shared-memory collectives inside a node.

Choose it with ``tdist.init(backend="gloo+shm")`` (or ``--backend gloo+shm`` wherever a backend
is taken); :func:`register` makes the name known to ``torch.distributed`` for code that calls
``dist.init_process_group("gloo+shm")`` itself. Inside a node, all-reduce (sum, avg, product,
min, max), reduce-scatter, all-gather, broadcast and barrier of float32/64, bfloat16, float16
and integer tensors go through POSIX shared memory; between nodes they are hierarchical (shm
inside each node, Gloo between node leaders); everything else is Gloo. See docs/shm.md for the reduction
order, the safety rules (segment names, cleanup, timeouts) and what is trusted.
"""

from __future__ import annotations

import torch.distributed as dist

from torsh_distributed.runtime._shm_backend import BACKEND_NAME, ShmProcessGroup, create
from torsh_distributed.runtime._shm_segment import cleanup_stale_segments
from torsh_distributed.runtime._shm_transport import REDUCE_OPS, ShmTransport

__all__ = [
    "BACKEND_NAME",
    "REDUCE_OPS",
    "ShmProcessGroup",
    "ShmTransport",
    "cleanup_stale_segments",
    "register",
]


def register() -> None:
    """Make ``"gloo+shm"`` a ``torch.distributed`` backend name (idempotent).

    Not done at import: a registered plug-in changes how torch picks the default backend of a
    ``"cpu:gloo,cuda:nccl"``-style string, so the name is added only when someone asks for it.
    """
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu"])
