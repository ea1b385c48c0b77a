"""The package's exception hierarchy.

User errors (a bad argument, an impossible combination) are ``ValueError`` / ``TypeError``; a few
of our classes also derive from ``ValueError`` so that ``except ValueError`` keeps working. Runtime
failures (a peer that never arrived, a corrupt checkpoint, a dead process) derive from
:class:`TorshDistributedError`. Every message names, where known, the rank, the operation and the
fix, so a log line alone tells what to do.
"""

from __future__ import annotations

__all__ = [
    "TorshDistributedError",
    "CommunicationError",
    "DistributedTimeoutError",
    "ConfigurationError",
    "CheckpointError",
    "ProcessFailureError",
    "FeatureNotAvailableError",
    "RankOutOfRangeError",
]


class TorshDistributedError(Exception):
    """Base class of every runtime failure raised by torsh-distributed.

    Args:
        message: What went wrong.
        rank: The rank that saw the failure, if known.
        operation: The operation that failed (``"all_reduce"``, ``"init"``, ``"store.get"``...).
        fix: What the user can do about it.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        operation: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.message = message
        self.rank = rank
        self.operation = operation
        self.fix = fix
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.operation:
            where.append(self.operation)
        text = f"[{', '.join(where)}] {self.message}" if where else self.message
        if self.fix:
            text += f" Fix: {self.fix}"
        return text

    def __reduce__(self):  # keep rank/operation/fix when sent between processes
        return (
            _rebuild,
            (type(self), self.message, self.rank, self.operation, self.fix),
        )


def _rebuild(cls, message, rank, operation, fix):  # noqa: ANN001, ANN202 - pickle helper
    return cls(message, rank=rank, operation=operation, fix=fix)


class CommunicationError(TorshDistributedError):
    """A collective or point-to-point operation failed."""


class DistributedTimeoutError(TorshDistributedError, TimeoutError):
    """An operation did not finish within its timeout (usually a peer never arrived)."""


class ConfigurationError(TorshDistributedError, ValueError):
    """The environment or configuration cannot describe a valid job (e.g. MASTER_ADDR missing)."""


class CheckpointError(TorshDistributedError):
    """A checkpoint is missing, partial or corrupt, or could not be written."""


class ProcessFailureError(TorshDistributedError):
    """A worker process died or exited with an error."""


class FeatureNotAvailableError(TorshDistributedError):
    """The feature needs something this installation lacks (a package, CUDA, a backend)."""


class RankOutOfRangeError(TorshDistributedError, ValueError):
    """A rank is negative or not below the world size."""


# What a rank sees when a *peer* died: such a rank is a victim, never the root cause while a rank
# that failed on its own exists. Used by the launcher's report and the test harness.
_PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
)


def is_peer_failure(message: str) -> bool:
    """True when ``message`` describes a failure caused by another rank disappearing."""
    lowered = message.lower()
    return any(marker in lowered for marker in _PEER_FAILURE_MARKERS)
