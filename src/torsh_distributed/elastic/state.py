"""A ``commit`` / ``restore`` / ``sync`` state object for user training loops (after Horovod's).

::

    state = ElasticState(model=model, optimizer=opt, manager=CheckpointManager("ckpt"), epoch=0, step=0)

    @elastic.run
    def train(state):
        for state.step in range(state.step, total):
            ...
            if state.step % 100 == 0:
                state.commit(step=state.step)   # in-memory snapshot + durable checkpoint

    train(state)   # after a restart by `torsh-dist run --max-restarts K`, continues at the last commit

Under torch's elastic agent a failed worker is not repaired in place: the agent stops every worker
and starts them again, so durability comes from the :class:`CheckpointManager` (``commit`` saves,
``run`` loads the newest valid checkpoint and syncs). ``restore`` rolls the in-memory state back
to the last commit, for code that catches a recoverable error (say, a NaN loss) itself. Plain
values (epoch, step, anything JSON) are attributes of the state.
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
        json.dumps(values)  # fail early on values a checkpoint could not hold
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
        else:
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
            self.optimizer.load_state_dict(snap["optim"])

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
        """Broadcast model parameters/buffers and the values from ``root`` to every rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        if self.model is not None:
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, src=root)
        blob = json.dumps(self._values).encode()
        size = torch.tensor([len(blob)], dtype=torch.int64)
        dist.broadcast(size, src=root)
        data = torch.zeros(int(size.item()), dtype=torch.uint8)
        if dist.get_rank() == root:
            data.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        dist.broadcast(data, src=root)
        object.__setattr__(self, "_values", json.loads(bytes(data.tolist()).decode()))


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
