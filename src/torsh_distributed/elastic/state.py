"""A ``commit`` / ``restore`` / ``sync`` state object for user training loops (after Horovod's).

::

    from torsh_distributed import elastic
    from torsh_distributed.checkpoint import CheckpointManager

    state = elastic.ElasticState(
        model=model, optimizer=opt, manager=CheckpointManager("ckpt"), epoch=0, step=0
    )

    @elastic.run
    def train(state):
        while state.step < total:
            ...                                # one optimizer step
            state.step += 1                    # steps done
            if state.step % 100 == 0:
                state.commit(step=state.step)  # in-memory snapshot + durable checkpoint

    train(state)   # after a restart by `torsh-dist run --max-restarts K`, continues at the last commit

Under torch's elastic agent a failed worker is not repaired in place: the agent stops every worker
and starts them again, so durability comes from the :class:`CheckpointManager` (``commit`` saves,
``run`` loads the newest valid checkpoint and syncs). ``restore`` rolls the in-memory state back
to the last commit, for code that catches a recoverable error (say, a NaN loss) itself. Plain
values (epoch, step, anything JSON) are attributes of the state. Nothing here knows the engine:
any model (plain, DDP or FSDP2) and any optimizer work.

Besides model and optimizer, anything with ``state_dict()`` / ``load_state_dict()`` that a loop
needs to continue exactly: a learning-rate ``scheduler`` and a loss ``scaler`` (their state is
the same on every rank and is saved as JSON in the checkpoint's metadata, so it loads at any world
size) and a gradient ``compressor`` (error-feedback residuals, PowerSGD factors: per rank, saved
in the rank's tensor file and restored when the world size is unchanged; a resized job starts it
afresh, with a warning).
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torsh_distributed.checkpoint.manager import CheckpointManager
from torsh_distributed.runtime.errors import CheckpointError

__all__ = ["ElasticState", "run"]

T = TypeVar("T")
_JSON_STATE = ("scheduler", "scaler")  # same on every rank: checkpoint metadata, any world size
_RANK_STATE = ("compressor",)  # per rank, with tensors: the rank's own file, same world size
_OWN = ("model", "optimizer", "manager", "_values", "_snapshot", "commits", *_JSON_STATE, *_RANK_STATE)


class ElasticState:
    """Model, optimizer, their companions and JSON values that can be committed, restored and
    synced.

    Args:
        model: The model (wrapped or not); may be ``None``.
        optimizer: Its optimizer; may be ``None``.
        manager: Where ``commit(step=...)`` saves durably and ``load_latest`` reads; ``None`` keeps
            commits in memory only (lost when the process dies).
        scheduler: A learning-rate scheduler (``torch.optim.lr_scheduler.*``); its state must be
            JSON (torch's schedulers' is), checked at each durable commit.
        scaler: A loss scaler (``torch.amp.GradScaler`` or the engine's); JSON state, like
            ``scheduler``.
        compressor: A gradient compressor (or its DDP hook state): per-rank tensor state, saved
            beside the rank's RNG state; restored only at the same world size.
        **values: JSON-serialisable values (``epoch=0``, ``step=0``), read and set as attributes.
    """

    def __init__(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        manager: CheckpointManager | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        compressor: Stateful | None = None,
        **values: Any,
    ) -> None:
        try:  # fail early on values a checkpoint could not hold
            json.dumps(values)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"ElasticState values must be JSON-serialisable: {exc}") from None
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "manager", manager)
        for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("compressor", compressor)):
            if obj is not None and not isinstance(obj, Stateful):
                raise TypeError(
                    f"ElasticState {name} must have state_dict() and load_state_dict(), got "
                    f"{type(obj).__name__}"
                )
            object.__setattr__(self, name, obj)
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_snapshot", None)
        object.__setattr__(self, "commits", 0)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(
            f"ElasticState has no value {name!r}; pass {name}=... to the constructor"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
            return
        try:  # here, not at the next durable commit, where the loop would die mid-run
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"ElasticState value {name!r} must be JSON-serialisable (numbers, strings, lists, "
                f"dicts); got {type(value).__name__}: {exc}"
            ) from None
        self._values[name] = value

    @property
    def values(self) -> dict[str, Any]:
        """A copy of the plain values."""
        return dict(self._values)

    def commit(self, *, step: int | None = None) -> None:
        """Snapshot the state in memory; with a manager and ``step``, also save a checkpoint.

        Collective when it saves (every rank must commit at the same step).
        """
        snapshot = {
            "values": copy.deepcopy(self._values),
            "model": copy.deepcopy(self.model.state_dict()) if self.model is not None else None,
            "optim": copy.deepcopy(self.optimizer.state_dict())
            if self.optimizer is not None
            else None,
            **{name: copy.deepcopy(obj.state_dict()) for name, obj in self._companions().items()},
        }
        object.__setattr__(self, "_snapshot", snapshot)
        self.commits += 1
        if self.manager is not None and step is not None and self.model is not None:
            state = {name: snapshot[name] for name in _JSON_STATE if name in snapshot}
            try:  # the checkpoint's metadata is JSON: say which object does not fit
                json.dumps(state)
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    f"ElasticState: the state_dict() of {', '.join(state)} must be "
                    f"JSON-serialisable to be checkpointed: {exc}"
                ) from None
            compressor = snapshot.get("compressor")
            self.manager.save(
                step,
                model=self.model,
                optimizer=self.optimizer,
                extra={"values": self._values, "state": state},
                rank_tensors={"compressor": compressor} if compressor is not None else None,
            )

    def _companions(self) -> dict[str, Stateful]:
        """Scheduler, scaler and compressor, those that were given."""
        names = (*_JSON_STATE, *_RANK_STATE)
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def restore(self) -> None:
        """Roll back to the last :meth:`commit`.

        Raises:
            CheckpointError: nothing was committed yet.
        """
        if self._snapshot is None:
            raise CheckpointError(
                "restore() before any commit(): nothing to roll back to",
                operation="elastic.restore",
                fix="call state.commit() first",
            )
        snap = self._snapshot
        object.__setattr__(self, "_values", copy.deepcopy(snap["values"]))
        if self.model is not None:
            self.model.load_state_dict(snap["model"])
        if self.optimizer is not None:
            # a copy: torch's load_state_dict keeps the given state tensors (same dtype and
            # device), so later steps would update the snapshot in place and a second restore
            # would roll back to the wrong state
            self.optimizer.load_state_dict(copy.deepcopy(snap["optim"]))
        for name, obj in self._companions().items():
            obj.load_state_dict(copy.deepcopy(snap[name]))  # a copy, for the same reason

    def load_latest(self) -> int | None:
        """Load the newest valid checkpoint of the manager (collective); its step, or ``None``."""
        if self.manager is None or self.model is None:
            return None
        loaded = self.manager.load(model=self.model, optimizer=self.optimizer)
        if loaded is None:
            return None
        extra = loaded.meta.get("extra", {})
        self._values.update(extra.get("values", {}))
        saved_state = extra.get("state", {})
        for name in _JSON_STATE:
            obj = getattr(self, name)
            if obj is not None and name in saved_state:
                obj.load_state_dict(saved_state[name])
        if self.compressor is not None:
            saved = (loaded.rank_tensors or {}).get("compressor")
            if saved is not None:
                self.compressor.load_state_dict(saved)
            else:
                warnings.warn(
                    f"checkpoint {loaded.path}: no compressor state for this rank (saved at world "
                    f"size {loaded.meta.get('world_size')}, or without a compressor); the "
                    "compressor starts afresh",
                    stacklevel=2,
                )
        return loaded.step

    def sync(self, *, root: int = 0) -> None:
        """Broadcast model parameters/buffers and the values from ``root`` to every rank.

        Collective. Sharded tensors (FSDP2's DTensor shards) differ per rank by design and are
        left alone: they agree because every rank loaded the same checkpoint. Optimizer state is
        not broadcast either: under torch's agent every worker restarts together, so each either
        starts empty or loads the same checkpoint (Horovod's sync serves workers that join a
        running job, which torch's agent does not do).
        """
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        if self.model is not None:
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                if not isinstance(tensor, DTensor):
                    dist.broadcast(tensor.data, src=root)
        # torch's object broadcast (it stages through the current CUDA device under NCCL, which
        # a hand-made CPU-tensor broadcast cannot use)
        box = [self._values if dist.get_rank() == root else None]
        dist.broadcast_object_list(box, src=root)
        object.__setattr__(self, "_values", box[0])


def run(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``fn(state, ...)``: load the newest checkpoint and sync before calling it.

    After an elastic restart the decorated function therefore continues from the last durable
    commit; on the first attempt (no checkpoint) it starts from the state as constructed.
    """

    @functools.wraps(fn)
    def wrapper(state: ElasticState, *args: Any, **kwargs: Any) -> T:
        state.load_latest()
        state.sync()
        state.commit()  # in-memory baseline for restore()
        return fn(state, *args, **kwargs)

    return wrapper
