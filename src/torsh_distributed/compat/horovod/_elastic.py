"""Horovod's elastic API (``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``) on torch's
elastic agent.

How Horovod's model maps onto ours:

* **Failure of a worker.** Horovod keeps the surviving processes, rolls their state back to the
  last ``commit()`` and re-forms the ring. torch's agent (``torsh-dist run --max-restarts K``,
  ``torsh-dist horovodrun --reset-limit K``) instead stops every worker and starts them all
  again. So ``commit()`` also writes rank 0's committed state to a file
  (``$TORSH_HOROVOD_ELASTIC_DIR/commit.pt``; ``horovodrun`` sets the variable to a fresh
  directory per job), and on a restarted attempt (``TORCHELASTIC_RESTART_COUNT > 0``) ``run``
  loads it on rank 0, runs the reset callbacks and syncs every rank from rank 0 before calling
  the function: the job continues from the last commit, as under Horovod. Without the variable,
  commits are kept in memory only and a restart starts over (with a warning).
* **HorovodInternalError** (a collective failed) inside the function: the state is restored to
  the last commit and the error is re-raised; the worker exits and the agent restarts the job.
  In-process recovery is impossible here: the dead peer cannot rejoin torch's process group.
* **HostsUpdatedInterrupt**: never raised by us (membership changes arrive as restarts), but if
  the function raises it, the reset callbacks run and the function is called again (after a sync
  unless ``skip_sync``), in process, as Horovod does.
* ``check_host_updates()`` has nothing to check and returns.

Trust: the commit file is a pickle (``torch.load(weights_only=False)``) written and read by the
job's own rank 0 in the job's directory; do not point ``TORSH_HOROVOD_ELASTIC_DIR`` at a
directory others can write.
"""

from __future__ import annotations

import abc
import copy
import functools
import math
import os
import random
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.utils.data

from torsh_distributed.compat.horovod import COMMIT_DIR_ENV
from torsh_distributed.compat.horovod._basics import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    rank,
    size,
)
from torsh_distributed.compat.horovod._functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = [
    "COMMIT_DIR_ENV",
    "ElasticSampler",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]

T = TypeVar("T")
_COMMIT_FILE = "commit.pt"
_warned_memory_only = False


def _restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _commit_path() -> str | None:
    directory = os.environ.get(COMMIT_DIR_ENV)
    return os.path.join(directory, _COMMIT_FILE) if directory else None


class State(abc.ABC):
    """Horovod's base state: reset callbacks and ``commit`` (save, then persist on rank 0)."""

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Run ``callbacks`` after each reset (here: after a restart, or a HostsUpdatedInterrupt),
        e.g. to rescale the learning rate to the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Reset, then run the registered callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory and, on rank 0 with ``TORSH_HOROVOD_ELASTIC_DIR`` set, to the
        commit file that a restarted job resumes from. Not collective."""
        self.save()
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:  # noqa: B027 - a no-op hook
        """Nothing to check: host changes reach the workers as a restart by torch's agent."""

    def _persist(self) -> None:
        global _warned_memory_only
        path = _commit_path()
        if path is None:
            if not _warned_memory_only and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):
                _warned_memory_only = True
                warnings.warn(
                    f"{COMMIT_DIR_ENV} is not set: commits are kept in memory only, so a restarted "
                    "job starts over; launch with `torsh-dist horovodrun` or set the variable",
                    stacklevel=3,
                )
            return
        if self._rank() != 0:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".commit-")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(self._payload(), f)
            os.replace(tmp, path)  # atomic: a crash mid-write leaves the previous commit
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _resume(self) -> bool:
        """On rank 0 of a restarted attempt, load the last durable commit; whether one was found."""
        path = _commit_path()
        if self._rank() != 0 or _restart_count() == 0 or path is None:
            return False
        if not os.path.exists(path):
            warnings.warn(
                f"restart {_restart_count()}: no commit in {os.path.dirname(path)}; "
                "starting from the initial state",
                stacklevel=3,
            )
            return False
        self._load(torch.load(path, map_location="cpu", weights_only=False))
        return True

    def _payload(self) -> dict[str, Any]:
        return {}

    def _load(self, payload: dict[str, Any]) -> None:  # noqa: B027 - a no-op hook
        """Make ``payload`` the committed state and restore it."""

    @abc.abstractmethod
    def save(self) -> None:
        """Save the state in memory."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Return to the last saved state."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every rank's state equal to rank 0's (collective)."""

    def reset(self) -> None:  # noqa: B027 - a no-op hook
        """Called on reset before the callbacks."""


class ObjectState(State):
    """Plain Python values as attributes (``epoch``, ``batch``); ``sync`` broadcasts the last
    saved values from rank 0."""

    def __init__(
        self, bcast_object: Callable[..., Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _payload(self) -> dict[str, Any]:
        return {"objects": self._saved_state}

    def _load(self, payload: dict[str, Any]) -> None:  # noqa: B027 - a no-op hook
        self._saved_state = payload["objects"]
        ObjectState.restore(self)


class StateHandler(abc.ABC):
    """Save / restore / sync of one stateful object held by :class:`TorchState`."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Any = None
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every rank's copy equal to rank 0's (collective)."""

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """A module: ``sync`` broadcasts its state dict from rank 0."""

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """An optimizer: ``sync`` is :func:`broadcast_optimizer_state` from rank 0."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: ``sync`` loads rank 0's position everywhere."""

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState``: a model, an optimizer, samplers and plain values.

    Modules, optimizers and :class:`ElasticSampler` objects passed as keyword arguments get a
    handler (save/restore/sync of their ``state_dict``); everything else is a plain value. Each
    is an attribute (``state.model``, ``state.epoch``).

    Args:
        model: A ``torch.nn.Module`` (or ``None``).
        optimizer: An optimizer (or ``None``), e.g. a ``hvd.DistributedOptimizer``.
        **kwargs: More modules / optimizers / samplers, and picklable values.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, values = {}, {}
        for key, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                values[key] = value
            else:
                handlers[key] = handler
        object.__setattr__(self, "_handlers", handlers)
        for key, handler in handlers.items():
            object.__setattr__(self, key, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **values)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _payload(self) -> dict[str, Any]:
        out = super()._payload()
        out["handlers"] = {key: h.saved for key, h in self._handlers.items()}
        return out

    def _load(self, payload: dict[str, Any]) -> None:  # noqa: B027 - a no-op hook
        for key, saved in payload.get("handlers", {}).items():
            if key in self._handlers:
                self._handlers[key].saved = saved
                self._handlers[key].restore()
        super()._load(payload)


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's sampler that skips the samples already processed this epoch.

    Shards ``range(len(dataset))`` (shuffled by ``seed + epoch``) over the ranks like
    ``DistributedSampler``, padding to a multiple of the world size. ``record_batch`` counts
    processed samples; kept in a :class:`TorchState`, the position survives restores and restarts.
    Call ``set_epoch`` at the *end* of each epoch.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order, nothing processed."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one processed batch of ``batch_size`` samples on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:  # noqa: B027 - a no-op hook
        """Re-shard the unprocessed samples over the current ranks."""
        self.num_replicas = size()
        self.rank = rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


_HANDLERS: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    return None


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Horovod's ``@hvd.elastic.run``: sync the state, call ``func(state, ...)``, recover.

    On a restarted attempt, rank 0 first loads the last durable commit and every rank runs the
    reset callbacks; then rank 0's state is synced to all and ``func`` runs. See the module
    docstring for how failures map onto restarts.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if not isinstance(state, State):
            raise TypeError(
                f"elastic.run: the first argument must be a TorchState/ObjectState, got "
                f"{type(state).__name__}"
            )
        if _restart_count() > 0:
            state._resume()
            state.on_reset()
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                raise
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            state.on_reset()

    return wrapper
