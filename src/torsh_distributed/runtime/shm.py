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

import os
import sys

import torch.distributed as dist

from torsh_distributed.runtime._shm_backend import (
    BACKEND_NAME,
    ShmProcessGroup,
    create,
    set_lenient,
)
from torsh_distributed.runtime._shm_segment import cleanup_stale_segments
from torsh_distributed.runtime._shm_transport import REDUCE_OPS, ShmTransport

__all__ = [
    "BACKEND_NAME",
    "REDUCE_OPS",
    "ShmProcessGroup",
    "ShmTransport",
    "cleanup_stale_segments",
    "register",
    "set_lenient",
    "unavailable_reason",
]


def register() -> None:
    """Make ``"gloo+shm"`` a ``torch.distributed`` backend name (idempotent).

    Not done at import: a registered plug-in changes how torch picks the default backend of a
    ``"cpu:gloo,cuda:nccl"``-style string, so the name is added only when someone asks for it.
    """
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu"])


def unavailable_reason() -> str | None:
    """Why ``backend="auto"`` should not choose ``gloo+shm`` here (``None``: it may).

    Needs Linux, a writable ``/dev/shm`` and the compiled C helper (its kernels are what the
    benchmarks measured; the Python fallback used without a compiler is slower).
    """
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)):
        return "no writable /dev/shm"
    if os.environ.get("TORSH_SHM_NO_CC") == "1":
        return "TORSH_SHM_NO_CC=1 (no C helper)"
    from torsh_distributed.runtime._shm_sync import load_flags
    from torsh_distributed.runtime.errors import FeatureNotAvailableError

    try:
        lib = load_flags()
    except FeatureNotAvailableError as exc:
        return str(exc).splitlines()[0]
    if lib is None:
        return "its C helper could not be built (no C compiler, or TORSH_SHM_NO_CC=1)"
    return None
