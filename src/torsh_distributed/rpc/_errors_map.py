"""Turn what torch.distributed.rpc raises, and what our trampoline returns, into typed errors."""

from __future__ import annotations

import pickle
from typing import Any

from torsh_distributed.rpc.errors import (
    PeerUnavailableError,
    RemoteError,
    RPCError,
    RPCTimeoutError,
    UnknownFunctionError,
)
from torsh_distributed.rpc.registry import _Failure

# torch's texts: "RPC ran for more than set timeout (1000 ms)...", "Timed out waiting for...",
# "RRef creation via rpc.remote() timed out...".
_TIMEOUT_MARKERS = ("timeout", "timed out")
# TensorPipe's texts when the peer's process or connection is gone.
_PEER_MARKERS = (
    "eof",
    "end of file",
    "broken pipe",
    "epipe",
    "connection reset",
    "econnreset",
    "connection refused",
    "econnrefused",
    "pipe closed",
    "shut down",
    "shutdown",
)


def translate(exc: BaseException, *, peer: str, function: str, timeout: float) -> BaseException:
    """The typed error for a failure torch raised while calling ``function`` on ``peer``."""
    if isinstance(exc, (RPCError, RemoteError, ValueError, TypeError)):
        return exc
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    lowered = text.lower()
    operation = f"rpc {function} on {peer}"
    if any(marker in lowered for marker in _TIMEOUT_MARKERS):
        return RPCTimeoutError(
            f"{function} on {peer} did not finish within {timeout:g} s ({first})",
            operation=operation,
            fix="raise the call's timeout, or find out why the peer is slow; the function may "
            "still be running there.",
        )
    if any(marker in lowered for marker in _PEER_MARKERS):
        return PeerUnavailableError(
            f"{peer} is unreachable while calling {function} (it died or shut down): {first}",
            operation=operation,
            fix=f"check {peer}'s log for why it stopped.",
        )
    return RPCError(f"calling {function} on {peer} failed: {first}", operation=operation)


def unwrap(value: Any, *, peer: str, function: str) -> Any:
    """The call's result, or the typed error the peer's trampoline reported."""
    if not isinstance(value, _Failure):
        return value
    operation = f"rpc {function} on {peer}"
    if value.kind == "unknown":
        raise UnknownFunctionError(
            f"no function {function!r} is registered on {value.peer}; registered there: "
            f"{list(value.registered)}",
            operation=operation,
            fix="register it with @rpc.register(name) in a module every worker imports.",
        )
    original: BaseException | None = None
    if value.pickled is not None:
        try:
            original = pickle.loads(value.pickled)  # noqa: S301 - a peer of the job (trusted)
        except Exception:  # noqa: BLE001 - the text below still tells what happened
            original = None
    short = value.remote_type.rsplit(".", 1)[-1]
    error = RemoteError(
        f"{function} raised {short} on {value.peer}: {value.message}",
        peer=value.peer,
        function=function,
        remote_type=value.remote_type,
        remote_traceback=value.remote_traceback,
        original=original,
        operation=operation,
    )
    raise error from original
