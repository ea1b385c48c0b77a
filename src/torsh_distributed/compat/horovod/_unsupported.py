"""The Horovod names this API does not provide, each with the reason and the alternative.

The public modules' ``__getattr__`` turns an access to one of them into
:class:`UnsupportedHorovodAPIError` (a ``NotImplementedError`` that is also an
``AttributeError``, so ``hasattr(hvd, "SyncBatchNorm")`` is ``False``); any other unknown name
is a plain ``AttributeError``.
"""

from __future__ import annotations

__all__ = ["UNSUPPORTED", "UnsupportedHorovodAPIError", "unsupported"]


class UnsupportedHorovodAPIError(NotImplementedError, AttributeError):
    """A Horovod API that torsh_distributed's Horovod layer does not implement."""


UNSUPPORTED: dict[str, str] = {
    "SyncBatchNorm": "use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) (CUDA only in "
    "torch), or plain BatchNorm",
    "start_timeline": "Horovod's timeline is not built; record collectives with "
    "torsh_distributed.comm.profiler (merged Chrome trace)",
    "stop_timeline": "Horovod's timeline is not built; see torsh_distributed.comm.profiler",
    "add_process_set": "process sets are not supported: every operation runs on all ranks",
    "remove_process_set": "process sets are not supported: every operation runs on all ranks",
    "mpi_lib": "there is no Horovod C++ library here",
    "mpi_lib_v2": "there is no Horovod C++ library here",
    "mpi_ops": "the operations are functions of this module (hvd.allreduce, ...)",
    "sync_batch_norm": "see SyncBatchNorm",
}
"""Horovod PyTorch names that are deliberately missing, with what to do instead."""

UNSUPPORTED_ELASTIC: dict[str, str] = {
    "notification_manager": "host notifications do not exist here: membership changes restart "
    "the workers (torch's elastic agent)",
    "WorkerNotificationManager": "see notification_manager",
}
"""Names of Horovod's elastic module that are deliberately missing."""


def unsupported(module: str, name: str) -> AttributeError:
    """The error for ``module.name``: :class:`UnsupportedHorovodAPIError` for a known Horovod
    name, a plain ``AttributeError`` otherwise."""
    reason = UNSUPPORTED.get(name) or UNSUPPORTED_ELASTIC.get(name)
    if reason is not None:
        return UnsupportedHorovodAPIError(
            f"Horovod's {name} is not supported by torsh_distributed's Horovod API: {reason} "
            "(see docs/horovod.md)"
        )
    return AttributeError(f"module {module!r} has no attribute {name!r}")
