"""Remote calls: :func:`rpc_sync`, :func:`rpc_async` (a typed :class:`Future`) and :func:`remote`
(a :class:`RemoteRef` to a value that stays on its owner).

The function is a module-level callable (pickled by reference: every worker must be able to
import it) or a name registered with :func:`~torsh_distributed.rpc.register`. Arguments and
results are pickled by torch's RPC pickler (tensors travel as tensors). Every call has a timeout
(the worker's default when not given); failures raise typed errors naming the peer and the
function: :class:`RPCTimeoutError`, :class:`PeerUnavailableError`, :class:`RemoteError`,
:class:`UnknownFunctionError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch.distributed import rpc as torch_rpc

from torsh_distributed.rpc import agent
from torsh_distributed.rpc._errors_map import translate, unwrap
from torsh_distributed.rpc.errors import RemoteRefReleasedError, RPCTimeoutError
from torsh_distributed.rpc.registry import _invoke, function_name

__all__ = ["Future", "RemoteRef", "rpc_sync", "rpc_async", "remote"]

T = TypeVar("T")
S = TypeVar("S")

Target = Callable[..., Any] | str


def _prepare(
    to: str,
    fn: Target,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    timeout: float | None,
) -> tuple[float, tuple[Any, ...]]:
    ctx = agent.current()
    if ctx is None:
        raise RuntimeError("RPC is not initialized; call torsh_distributed.rpc.init() first")
    if not isinstance(to, str):
        raise TypeError(f"to must be a worker name (str), got {type(to).__name__}")
    if to not in ctx.worker_names:
        raise ValueError(f"no RPC worker named {to!r}; the workers are {list(ctx.worker_names)}")
    if isinstance(fn, str):
        if not fn:
            raise ValueError("a function name must not be empty")
    elif not callable(fn):
        raise TypeError(f"fn must be a callable or a registered name, got {type(fn).__name__}")
    else:
        qualname = getattr(fn, "__qualname__", "")
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"{qualname} cannot be called remotely (functions travel by module and name); "
                "define it at module level or @rpc.register it"
            )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping, got {type(kwargs).__name__}")
    if timeout is None:
        timeout = ctx.config.timeout
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout), (fn, tuple(args), dict(kwargs or {}))


class Future(Generic[T]):
    """The result of :func:`rpc_async`, to :meth:`wait` for or chain with :meth:`then`.

    Errors are the typed ones of :func:`rpc_sync`, raised by :meth:`wait`.
    """

    __slots__ = ("_fut", "_peer", "_function", "_timeout", "_raw")

    def __init__(
        self, fut: torch.futures.Future, *, peer: str, function: str, timeout: float, raw: bool
    ) -> None:
        self._fut = fut
        self._peer = peer
        self._function = function
        self._timeout = timeout
        self._raw = raw  # True: the value is final (a .then() result), not a trampoline outcome

    def done(self) -> bool:
        """True once the result (or error) arrived; :meth:`wait` then returns at once."""
        return bool(self._fut.done())

    def wait(self) -> T:
        """Block until the call finished (at most its timeout) and return its result.

        Raises:
            RPCTimeoutError / PeerUnavailableError / RemoteError / UnknownFunctionError: the call
            failed; the message names the peer and the function.
        """
        try:
            value = self._fut.wait()
        except Exception as exc:  # noqa: BLE001 - typed below
            typed = translate(exc, peer=self._peer, function=self._function, timeout=self._timeout)
            if typed is exc:
                raise
            raise typed from exc
        if self._raw:
            return value  # type: ignore[no-any-return]
        return unwrap(value, peer=self._peer, function=self._function)  # type: ignore[no-any-return]

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A future of ``callback(self)``, run once this one is done.

        The callback runs on an RPC thread: keep it short and never block in it. It receives
        this (completed) future; its :meth:`wait` returns the result or raises the typed error.
        An exception the callback raises is what the returned future's :meth:`wait` raises.
        """
        child: torch.futures.Future = torch.futures.Future()

        def run(_: torch.futures.Future) -> None:
            try:
                child.set_result(callback(self))
            except BaseException as exc:  # noqa: BLE001 - delivered through the child future
                child.set_exception(exc)

        self._fut.add_done_callback(run)
        return Future(
            child, peer=self._peer, function=self._function, timeout=self._timeout, raw=True
        )

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"Future({self._function} on {self._peer}, {state})"


def rpc_sync(
    to: str,
    fn: Callable[..., T] | str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
) -> T:
    """Call ``fn(*args, **kwargs)`` on worker ``to`` and return its result.

    Args:
        to: The peer's worker name (may be this worker's own).
        fn: A module-level callable, or a name registered on the peer.
        args: Positional arguments (pickled; tensors are sent as tensors).
        kwargs: Keyword arguments.
        timeout: Seconds before :class:`RPCTimeoutError`; default the worker's ``timeout``.
            The remote function is not interrupted: it runs on, holding a server thread.

    Raises:
        RPCTimeoutError: no answer within ``timeout`` (raised within about ``timeout + 1`` s).
        PeerUnavailableError: the peer's connection closed (it died or shut down).
        RemoteError: ``fn`` raised on the peer (with the remote traceback).
        UnknownFunctionError: ``fn`` is a name the peer has not registered.
        ValueError / TypeError: an unknown worker, a local or lambda function, bad arguments.
    """
    return rpc_async(to, fn, args, kwargs, timeout=timeout).wait()


def rpc_async(
    to: str,
    fn: Callable[..., T] | str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
) -> Future[T]:
    """Start ``fn(*args, **kwargs)`` on worker ``to``; return a :class:`Future` of its result.

    Arguments and errors are those of :func:`rpc_sync`; errors surface from ``Future.wait()``.
    """
    seconds, payload = _prepare(to, fn, args, kwargs, timeout)
    name = function_name(fn)
    try:
        fut = torch_rpc.rpc_async(to, _invoke, args=payload, timeout=seconds)
    except Exception as exc:  # noqa: BLE001 - e.g. an argument that does not pickle
        typed = translate(exc, peer=to, function=name, timeout=seconds)
        if typed is exc:
            raise
        raise typed from exc
    return Future(fut, peer=to, function=name, timeout=seconds, raw=False)


class RemoteRef(Generic[T]):
    """A reference to the value ``fn`` returned on its owner, made by :func:`remote`.

    The value stays on the owner until every reference is released: call :meth:`release` when
    done (dropping the last Python reference releases it too). A released reference, or one
    whose creation failed or timed out, raises on every use instead of hanging. A reference may
    be passed as an argument of other calls (for example to its owner, which reads it with
    :meth:`local_value`).
    """

    __slots__ = ("_rref", "_owner", "_function", "_timeout", "_lock", "_failure", "__weakref__")

    def __init__(self, rref: Any, *, owner: str, function: str, timeout: float) -> None:
        self._rref: Any | None = rref
        self._owner = owner
        self._function = function
        self._timeout = timeout
        self._lock = threading.Lock()
        self._failure: BaseException | None = None

    def owner(self) -> str:
        """Name of the worker that holds the value."""
        return self._owner

    @property
    def released(self) -> bool:
        """True after :meth:`release`."""
        return self._rref is None

    def _live(self, action: str) -> Any:
        with self._lock:
            rref = self._rref
        if rref is None:
            raise RemoteRefReleasedError(
                f"cannot {action}: the RemoteRef to {self._function} on {self._owner} was released",
                operation=f"RemoteRef.{action}",
                fix="keep the reference until you are done with it; release() it last.",
            )
        if self._failure is not None:
            raise self._failure
        return rref

    def _creation_failed(self, exc: BaseException) -> BaseException:
        typed = translate(exc, peer=self._owner, function=self._function, timeout=self._timeout)
        if isinstance(typed, RPCTimeoutError):
            typed = RPCTimeoutError(
                f"remote({self._function}) on {self._owner} timed out creating the value; "
                "this RemoteRef is unusable (the value may still appear on the owner and is "
                "freed at shutdown)",
                operation=f"remote {self._function} on {self._owner}",
                fix="raise remote()'s timeout, or find out why the owner is slow.",
            )
        self._failure = typed
        return typed

    def to_here(self, timeout: float | None = None) -> T:
        """Copy the value to this worker and return it.

        Args:
            timeout: Seconds to wait; default the timeout :func:`remote` was given.

        Raises:
            RemoteRefReleasedError: the reference was released.
            RPCTimeoutError: the creation or this copy timed out (a timed-out creation makes
                the reference unusable for good).
            RemoteError / UnknownFunctionError / PeerUnavailableError: as for :func:`rpc_sync`.
        """
        rref = self._live("to_here")
        seconds = self._timeout if timeout is None else float(timeout)
        if not seconds > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        # torch's own to_here() on a ref whose creation failed may hang or fail vaguely
        # (pytorch #44771): look at the creation first, and again when the copy fails.
        creation = rref._get_future()
        failed = _error_of(creation)
        if failed is not None:
            raise self._creation_failed(failed) from failed
        try:
            value = rref.to_here(timeout=seconds)
        except Exception as exc:  # noqa: BLE001 - typed below
            failed = _error_of(creation)
            if failed is not None or "creation" in str(exc).lower():
                raise self._creation_failed(failed or exc) from exc
            raise translate(
                exc, peer=self._owner, function=self._function, timeout=seconds
            ) from exc
        return unwrap(value, peer=self._owner, function=self._function)  # type: ignore[no-any-return]

    def local_value(self) -> T:
        """The value itself, on its owner (no copy).

        Raises:
            RemoteRefReleasedError: the reference was released.
            RuntimeError: called on a worker that is not the owner.
        """
        rref = self._live("local_value")
        if not rref.is_owner():
            raise RuntimeError(
                f"local_value() works on the owner {self._owner} only; use to_here() elsewhere"
            )
        return unwrap(rref.local_value(), peer=self._owner, function=self._function)  # type: ignore[no-any-return]

    def release(self) -> None:
        """Drop this reference; the owner frees the value once no reference is left.

        Later uses raise :class:`RemoteRefReleasedError`. Releasing twice is a no-op.
        """
        with self._lock:
            self._rref = None  # torch's reference count sends the delete to the owner

    def __reduce__(self) -> tuple[Any, ...]:
        rref = self._live("be sent")
        return (_rebuild_ref, (rref, self._owner, self._function, self._timeout))

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return f"RemoteRef({self._function} on {self._owner}, {state})"


def _error_of(fut: torch.futures.Future) -> BaseException | None:
    """The exception a completed future holds; ``None`` when it is pending or succeeded."""
    if not fut.done():
        return None
    try:
        fut.wait()
    except Exception as exc:  # noqa: BLE001 - returned, not raised
        return exc
    return None


def _rebuild_ref(rref: Any, owner: str, function: str, timeout: float) -> RemoteRef[Any]:
    return RemoteRef(rref, owner=owner, function=function, timeout=timeout)


def remote(
    to: str,
    fn: Callable[..., T] | str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
) -> RemoteRef[T]:
    """Run ``fn(*args, **kwargs)`` on worker ``to`` and keep the result there.

    Returns at once with a :class:`RemoteRef`; errors (including a creation that takes longer
    than ``timeout``) surface from :meth:`RemoteRef.to_here`. Arguments are those of
    :func:`rpc_sync`.
    """
    seconds, payload = _prepare(to, fn, args, kwargs, timeout)
    name = function_name(fn)
    try:
        rref = torch_rpc.remote(to, _invoke, args=payload, timeout=seconds)
    except Exception as exc:  # noqa: BLE001 - e.g. an argument that does not pickle
        typed = translate(exc, peer=to, function=name, timeout=seconds)
        if typed is exc:
            raise
        raise typed from exc
    return RemoteRef(rref, owner=to, function=name, timeout=seconds)
