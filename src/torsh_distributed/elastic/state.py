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
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torsh_distributed.checkpoint.manager import CheckpointManager
from torsh_distributed.runtime.errors import CheckpointError

__all__ = ["ElasticState", "run"]

T = TypeVar("T")
_OWN = ("model", "optimizer", "manager", "_values", "_snapshot", "commits")


class ElasticState:
    """Model, optimizer and JSON values that can be committed, restored and synced.

    Args:
        model: The model (wrapped or not); may be ``None``.
        optimizer: Its optimizer; may be ``None``.
        manager: Where ``commit(step=...)`` saves durably and ``load_latest`` reads; ``None`` keeps
            commits in memory only (lost when the process dies).
        **values: JSON-serialisable values (``epoch=0``, ``step=0``), read and set as attributes.
    """

    def __init__(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        manager: CheckpointManager | None = None,
        **values: Any,
    ) -> None:
        try:  # fail early on values a checkpoint could not hold
            json.dumps(values)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"ElasticState values must be JSON-serialisable: {exc}") from None
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "manager", manager)
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
        }
        object.__setattr__(self, "_snapshot", snapshot)
        self.commits += 1
        if self.manager is not None and step is not None and self.model is not None:
            self.manager.save(
                step, model=self.model, optimizer=self.optimizer, extra={"values": self._values}
            )

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

    def load_latest(self) -> int | None:
        """Load the newest valid checkpoint of the manager (collective); its step, or ``None``."""
        if self.manager is None or self.model is None:
            return None
        loaded = self.manager.load(model=self.model, optimizer=self.optimizer)
        if loaded is None:
            return None
        self._values.update(loaded.meta.get("extra", {}).get("values", {}))
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
