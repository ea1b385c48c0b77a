"""Handles of asynchronous operations (``poll`` / ``synchronize``), Horovod's scaling rules, the
error translation to :class:`HorovodInternalError`, and CPU tensors under NCCL.

A Horovod handle is an integer looked up in a table; ours is a :class:`Handle` object that holds
torch's work objects and the step that finishes the result (the division of Average, the trim of
an uneven all-gather). Scripts only pass handles to ``poll``/``synchronize``, so either works.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.compat.horovod._basics import HorovodInternalError
from torsh_distributed.runtime.errors import TorshDistributedError

__all__ = ["Handle", "done", "guard", "poll", "scale_", "staged", "synchronize"]


@contextlib.contextmanager
def guard(operation: str) -> Iterator[None]:
    """Turn a backend failure (a dead peer, a timeout) into :class:`HorovodInternalError`.

    User errors (``ValueError``, ``TypeError``, ``NotImplementedError``) pass unchanged.
    """
    try:
        yield
    except HorovodInternalError:
        raise
    except (RuntimeError, TorshDistributedError) as exc:
        if isinstance(exc, NotImplementedError):
            raise
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HorovodInternalError(
            text,
            rank=dist.get_rank() if dist.is_initialized() else None,
            operation=operation,
            fix="a peer probably failed; under elastic.run the launcher restarts the workers "
            "(--max-restarts / --reset-limit) and they resume from the last commit",
        ) from exc


class Handle:
    """An operation in flight: :func:`poll` tells whether it finished, :func:`synchronize`
    waits and returns its result.

    Args:
        works: torch work objects (``wait()`` / ``is_completed()``); empty when already done.
        finish: Called once after every work finished; returns the operation's result.
        operation: Horovod's name of the operation (for error messages).
        name: The ``name=`` the caller gave, if any (recorded only: torch matches collectives by
            the order in which ranks issue them, not by name).
    """

    __slots__ = ("_works", "_finish", "_result", "_done", "operation", "name")

    def __init__(
        self,
        works: Sequence[Any],
        finish: Callable[[], Any],
        *,
        operation: str,
        name: str | None = None,
    ) -> None:
        self._works = list(works)
        self._finish: Callable[[], Any] | None = finish
        self._result: Any = None
        self._done = False
        self.operation = operation
        self.name = name

    def poll(self) -> bool:
        """True once the result is ready (``synchronize`` will not block)."""
        if self._done:
            return True
        with guard(self.operation):
            return all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        """Block until done; the result (the same object on later calls)."""
        if not self._done:
            with guard(self.operation):
                for work in self._works:
                    work.wait()
                finish, self._finish = self._finish, None
                assert finish is not None
                self._result = finish()
            self._works = []
            self._done = True
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        label = f" {self.name!r}" if self.name else ""
        return f"<Handle {self.operation}{label} {state}>"


def done(result: Any, *, operation: str, name: str | None = None) -> Handle:
    """A handle whose operation already finished with ``result``."""
    return Handle((), lambda: result, operation=operation, name=name)


def poll(handle: Handle) -> bool:
    """Whether the asynchronous operation of ``handle`` has finished (Horovod's ``hvd.poll``)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll() takes a handle returned by an *_async function, got {handle!r}")
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s operation and return its output (Horovod's ``hvd.synchronize``).

    Raises:
        HorovodInternalError: the collective failed (a peer died, a timeout).
    """
    if not isinstance(handle, Handle):
        raise TypeError(
            f"synchronize() takes a handle returned by an *_async function, got {handle!r}"
        )
    return handle.wait()


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place as Horovod does: integers in fp64 then cast back (truncating toward
    zero), fp16/bf16 in fp32, other floating types in their own precision."""
    if factor == 1.0:
        return tensor
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor.copy_(tensor.float().mul_(factor))
    elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.mul_(factor)
    else:
        tensor.copy_(tensor.double().mul_(factor).trunc_())
    return tensor


def staged(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """The tensor the backend can send, and the copy back into ``tensor`` once received.

    NCCL sends CUDA tensors only; a CPU tensor (a metric, a byte buffer of broadcast_object) goes
    through the current CUDA device, which Horovod's CPU path does without a copy. Gloo sends
    either kind, so there is nothing to do.
    """
    if (
        tensor.device.type == "cpu"
        and dist.is_initialized()
        and dist.get_backend() == "nccl"
        and torch.cuda.is_available()
    ):
        device_copy = tensor.to(torch.device("cuda", torch.cuda.current_device()))

        def back() -> None:
            tensor.copy_(device_copy)

        return device_copy, back
    return tensor, lambda: None
