"""Typed errors of the RPC layer, all under the package's :class:`TorshDistributedError`.

Every message names the peer and the function, so one log line tells which call failed where:

* :class:`RPCTimeoutError` (a :class:`DistributedTimeoutError`, so also a ``TimeoutError``): the
  call did not finish within its timeout; the remote function may still be running.
* :class:`PeerUnavailableError`: the peer's connection broke (it died or shut down).
* :class:`RemoteError`: the remote function raised; carries the remote traceback text.
* :class:`UnknownFunctionError` (also ``ValueError``): no function of that name is registered on
  the peer; the message lists the names that are.
* :class:`RemoteRefReleasedError` (also ``ValueError``): a :class:`RemoteRef` was used after
  :meth:`~RemoteRef.release`.
"""

from __future__ import annotations

from torsh_distributed.runtime.errors import (
    CommunicationError,
    DistributedTimeoutError,
    TorshDistributedError,
)

__all__ = [
    "RPCError",
    "RPCTimeoutError",
    "PeerUnavailableError",
    "RemoteError",
    "UnknownFunctionError",
    "RemoteRefReleasedError",
]


class RPCError(CommunicationError):
    """A remote call failed (base class of the RPC layer's runtime errors)."""


class RPCTimeoutError(RPCError, DistributedTimeoutError):
    """A remote call (or the creation of a remote reference) did not finish within its timeout."""


class PeerUnavailableError(RPCError):
    """The peer could not be reached: its connection closed (it died or shut down)."""


class UnknownFunctionError(RPCError, ValueError):
    """The peer has no function registered under the name that was called."""


class RemoteRefReleasedError(RPCError, ValueError):
    """A :class:`~torsh_distributed.rpc.RemoteRef` was used after it was released."""


class RemoteError(TorshDistributedError):
    """The function raised on the peer.

    Attributes:
        peer: Name of the worker the function ran on.
        function: Name of the function (registered name or ``module.qualname``).
        remote_type: ``module.QualName`` of the exception raised remotely.
        remote_traceback: The formatted traceback from the peer.
        original: The remote exception itself when it could be pickled, else ``None``; it is
            also this error's ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str = "",
        function: str = "",
        remote_type: str = "",
        remote_traceback: str = "",
        original: BaseException | None = None,
        rank: int | None = None,
        operation: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.peer = peer
        self.function = function
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.original = original
        super().__init__(message, rank=rank, operation=operation, fix=fix)

    def _format(self) -> str:
        text = super()._format()
        if self.remote_traceback:
            text += f"\n--- traceback on {self.peer} ---\n{self.remote_traceback.rstrip()}"
        return text

    def __reduce__(self):  # noqa: ANN204 - keep the remote details when pickled
        return (
            _rebuild_remote,
            (
                self.message,
                self.peer,
                self.function,
                self.remote_type,
                self.remote_traceback,
                self.rank,
                self.operation,
                self.fix,
            ),
        )


def _rebuild_remote(  # noqa: PLR0913 - pickle helper
    message: str,
    peer: str,
    function: str,
    remote_type: str,
    remote_traceback: str,
    rank: int | None,
    operation: str | None,
    fix: str | None,
) -> RemoteError:
    return RemoteError(
        message,
        peer=peer,
        function=function,
        remote_type=remote_type,
        remote_traceback=remote_traceback,
        rank=rank,
        operation=operation,
        fix=fix,
    )
