"""Functions callable by name, and the trampoline every call runs through on the peer.

Register a function on every worker that should serve it (at import time, so each process has
it before :func:`~torsh_distributed.rpc.init` returns)::

    @rpc.register("ps.push")
    def push(key: str, grad: torch.Tensor) -> None: ...

    rpc.rpc_sync("ps0", "ps.push", args=("w", grad))

The registry is per process: the callee's registry decides, and an unknown name fails with
:class:`~torsh_distributed.rpc.UnknownFunctionError` listing the names the callee has.
"""

from __future__ import annotations

import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["register", "registered_names", "unregister", "function_name"]

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_functions: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[F], F]:
    """Decorator: make the function callable by peers as ``name``.

    Args:
        name: The name callers pass instead of the function. Registering another function under
            a taken name is an error; registering the same one again is a no-op.

    Raises:
        ValueError: ``name`` is empty or already taken by a different function.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a registered name must be a non-empty str, got {name!r}")

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"register({name!r}) needs a callable, got {type(fn).__name__}")
        with _lock:
            known = _functions.get(name)
            if known is not None and known is not fn:
                raise ValueError(
                    f"{name!r} is already registered to {function_name(known)}; "
                    f"unregister it first or pick another name"
                )
            _functions[name] = fn
        return fn

    return decorate


def unregister(name: str) -> None:
    """Forget ``name`` (a no-op when it is not registered)."""
    with _lock:
        _functions.pop(name, None)


def registered_names() -> list[str]:
    """The names registered in this process, sorted."""
    with _lock:
        return sorted(_functions)


def function_name(fn: Callable[..., Any] | str) -> str:
    """How errors name a call target: the registered name or ``module.qualname``."""
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True, slots=True)
class _Failure:
    """What the peer sends back when the call did not return (picklable, no live objects)."""

    kind: str  # "raised" or "unknown"
    peer: str
    remote_type: str = ""
    message: str = ""
    remote_traceback: str = ""
    pickled: bytes | None = None  # the exception itself, when it pickles
    registered: tuple[str, ...] = ()


def _worker_name() -> str:
    from torch.distributed import rpc as torch_rpc

    try:
        return str(torch_rpc.get_worker_info().name)
    except RuntimeError:  # pragma: no cover - only outside an RPC agent
        return "?"


def _invoke(target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run on the peer: resolve ``target``, call it, turn an exception into a :class:`_Failure`.

    Exceptions never reach torch's own handler, which prints them to the peer's stderr and
    rebuilds them on the caller from a string (failing for types that need other arguments).
    """
    if isinstance(target, str):
        with _lock:
            fn = _functions.get(target)
            names = tuple(sorted(_functions))
        if fn is None:
            return _Failure(kind="unknown", peer=_worker_name(), registered=names)
    else:
        fn = target
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
        try:
            pickled: bytes | None = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
            pickled = None
        return _Failure(
            kind="raised",
            peer=_worker_name(),
            remote_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            remote_traceback=traceback.format_exc(),
            pickled=pickled,
        )
