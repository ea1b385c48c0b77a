"""The engine's run with fault-tolerant replica groups (``ft.replica_groups`` > 1; private).

:class:`FTRun` is the engine's :class:`~torsh_distributed.engine._run.Run` with four hooks into
:class:`~torsh_distributed.ft.replica.ReplicaGroups`: the quorum before each step (a restarted
group heals there), the group's share of each training batch, the cross-group gradient average
and commit vote after the group's own exchange (DDP's all-reduce or ZeRO's reduce-scatter), and
the summary's ``ft`` section. A step that does not commit (a group died in it) is trained again
with the new quorum: same step, same batch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from torsh_distributed.data.sampler import GlobalSampler, shard
from torsh_distributed.engine import _setup as S
from torsh_distributed.engine._run import Run
from torsh_distributed.engine.result import TrainResult, write_json_atomic
from torsh_distributed.ft.replica import ReplicaGroups

__all__ = ["FTRun"]


class _Redo(Exception):
    """The step did not commit on every group: train it again."""


class FTRun(Run):
    """A run whose data-parallel ranks are one replica group of several (see the module doc)."""

    ft: ReplicaGroups

    def setup(self) -> None:
        self.ft = ReplicaGroups(
            self.cfg.ft, group_rank=self.runtime.rank, group_size=self.runtime.world_size
        )  # refuses a run not started by the replica-group launcher, before any collective
        super().setup()  # its plan splits the batch over the groups, then a group's data ranks
        self.ft.attach(
            self,
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ["MASTER_PORT"]),
        )
        self._stack.callback(self.ft.close)
        self._group_loss: torch.Tensor | None = None

    def steps(self) -> Iterator[int]:
        """The steps to train: torchft's step after each quorum (a redone step comes again)."""
        while (step := self.ft.next_step()) < self.cfg.max_steps:
            yield step

    def step(self, step: int) -> None:
        try:
            super().step(step)
        except _Redo:
            self.write(
                f"ft: step {step + 1} did not commit on every group (a group left): "
                "training it again with the groups present"
            )

    # --- the hooks -------------------------------------------------------------------------

    def _batch(
        self, dataset: Any, sampler: GlobalSampler, step: int, non_blocking: bool = False
    ) -> tuple[Any, Any]:
        if sampler is not self.engine.train_sampler:  # evaluation: every group the whole batch
            return super()._batch(dataset, sampler, step, non_blocking)
        dims = self.dims
        mine = self.ft.shard(sampler.indices(step))
        indices = shard(mine, rank=dims.data_rank(), num_ranks=dims.data_degree)
        return S.to_device(self._fetch(dataset, indices), self.device, non_blocking=non_blocking)

    def _forward_backward(self, x: Any, y: Any) -> torch.Tensor | None:
        self._group_loss = super()._forward_backward(x, y)
        return self._group_loss

    def _exchange_grads(self) -> None:
        super()._exchange_grads()  # nothing for DDP/ZeRO: their wrappers reduced in backward
        assert self._group_loss is not None
        averaged = self.ft.exchange(self.params, self._group_loss)
        if averaged is None:
            raise _Redo
        self._group_loss = averaged
        self.monitor.phase("comm_wait")

    def _record(
        self, step: int, loss: torch.Tensor | None, *, lr: float, grad_norm: torch.Tensor | None
    ) -> float:
        value = super()._record(step, self._group_loss, lr=lr, grad_norm=grad_norm)
        self.monitor.track_metrics({"ft/groups": len(self.ft.history[-1])}, step=step + 1)
        return value

    # --- what a healing peer reads and restores ---------------------------------------------

    @property
    def model(self) -> nn.Module:
        return self.built.holder

    @property
    def scaler_state(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_scaler_state(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)

    @property
    def compression_state(self) -> Any:
        return self.compression.stateful

    # --- the end ---------------------------------------------------------------------------

    def finish(self) -> TrainResult:
        summary_json, reports = self.cfg.summary_json, self.ft.reports
        self.cfg = dataclasses.replace(self.cfg, summary_json="")  # written below, with ft
        result = super().finish()
        result.ft = self.ft.summary()
        if reports and summary_json:
            write_json_atomic(summary_json, result.summary())
        return result


def train_steps(run: Run, start: int, stop: int) -> Iterable[int]:
    """The engine loop's steps: torchft's under replica groups, else ``start .. stop - 1``."""
    return run.steps() if isinstance(run, FTRun) else range(start, stop)
