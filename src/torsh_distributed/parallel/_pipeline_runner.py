"""The runner of a pipeline's stages on one rank (built by
:func:`~torsh_distributed.parallel.pipeline.build_pipeline`): its schedule, parameters, state for
checkpoints, and the first step's check of the model's forward
(:mod:`~torsh_distributed.parallel._pipeline_trace`) that keeps the split by module or traces it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.stage import _PipelineStageBase

from torsh_distributed.parallel._pipeline_trace import (
    Prune,
    Schedule,
    check_forward,
    first_microbatch,
    make_schedule,
    traced_stages,
)

if TYPE_CHECKING:
    from torsh_distributed.parallel.pipeline import StageSplit

__all__ = ["Deferred", "PipelineRunner"]


def _merged(modules: Sequence[nn.Module]) -> nn.Module:
    """One view of pruned copies of a model: the union of their children, shared, not copied."""
    unique = list({id(m): m for m in modules}.values())
    if len(unique) == 1:
        return unique[0]
    direct = [
        n for m in unique for n, t in [*m._parameters.items(), *m._buffers.items()] if t is not None
    ]
    if direct:
        raise ValueError(
            f"stage modules hold parameters or buffers {direct} directly on the container's "
            "path (a transform added them?): their stages' views cannot be merged"
        )
    view = nn.Module()
    names = list(dict.fromkeys(n for m in unique for n in m._modules))
    for name in names:
        children = [m._modules[name] for m in unique if m._modules.get(name) is not None]
        if children:
            view._modules[name] = _merged(children)
    return view


@dataclass(kw_only=True, slots=True)
class Deferred:
    """What the first step needs to check the forward and, if it must, trace the split."""

    skeleton: nn.Module
    name: str
    schedule: str
    microbatches: int
    loss_fn: Callable[[Any, Any], torch.Tensor]
    device: torch.device
    group: dist.ProcessGroup | None
    stage_ids: list[int]
    prune: Prune
    """``stage_module(model, split, stage)`` as ``prune(model, stage)``."""


class PipelineRunner:
    """The stages this rank holds and the schedule that runs them; one :meth:`step` per batch.

    ``traced`` says how the model was split: ``False`` by module (its forward skips ``None``
    modules), ``True`` by tracing (it does not); it is settled by the first :meth:`step`.
    """

    def __init__(
        self,
        stages: Sequence[_PipelineStageBase],
        modules: list[nn.Module],
        schedule: Schedule,
        *,
        split: StageSplit,
        deferred: Deferred | None = None,
    ) -> None:
        self.stages, self.modules, self.schedule, self.split = list(stages), modules, schedule, split
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.traced = False
        self._deferred = deferred
        self._eval_schedule: Schedule | None = None
        self._why = ""  # the check's finding, the start of a traced split's errors

    def parameters(self) -> list[nn.Parameter]:
        """Parameters of this rank's stages (each once)."""
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def state_module(self) -> nn.Module:
        """One module holding this rank's stages under the unsplit model's names, for checkpoints.

        With one stage per rank it is the stage module; with several (interleaved) a view whose
        children are the union of the stages' (shared, not copied: loading into it loads the
        stages). Its ``state_dict()`` holds this rank's subset of the whole model's keys, disjoint
        from other pipeline ranks', so a DCP checkpoint written by all ranks is the whole model.
        The view is for state only: it has no ``forward``.
        """
        return _merged(self.modules)

    def _traced_schedule(self, x: Any, *, training: bool, why: str) -> Schedule:
        d = self._deferred
        assert d is not None
        args, kwargs = first_microbatch(x, d.microbatches)
        stages = traced_stages(
            d.skeleton, self.split, self.modules, d.stage_ids, args, kwargs,
            device=d.device, group=d.group, training=training, why=why,
        )
        if training:
            self.stages = stages
        return make_schedule(d.schedule, stages, d.microbatches, d.loss_fn)

    def _settle(self, x: Any) -> None:
        """Before the first step: keep the split by module, or trace, or raise (every rank)."""
        d = self._deferred
        if d is None or self.traced:
            return
        if x is None:
            raise ValueError(
                "the first PipelineRunner.step needs the batch input on every pipeline rank "
                "(its shapes check the model's forward before the stages communicate)"
            )
        found = check_forward(
            d.skeleton, self.split, d.prune,
            *first_microbatch(x, d.microbatches),
        )
        if found.wrong_call is None:
            if found.inconclusive is not None:
                warnings.warn(
                    f"could not check on meta that the forward of {d.name} skips the modules of "
                    f"other pipeline stages ({found.inconclusive}); the split by module assumes it",
                    stacklevel=3,
                )
            self._deferred = None  # the split by module stands; drop the skeleton
            return
        self._why = f"{d.name}: {found.wrong_call}"
        self.schedule = self._traced_schedule(x, training=True, why=self._why)
        self.traced = True

    def _run(self, run: Callable[..., object], x: Any, y: Any) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        if self.has_first:
            run(x, target=y if self.has_last else None, losses=losses)
        elif self.has_last:
            run(target=y, losses=losses)
        else:
            run()
        if not self.has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    def step(self, x: Any, y: Any) -> torch.Tensor | None:
        """Forward and backward of one batch (gradients accumulate into the stages' ``.grad``).

        ``x`` is needed on every rank at the first step (only its shapes are read there).

        Returns:
            The batch's mean loss on the rank holding the last stage, else ``None``.

        Raises:
            ValueError: at the first step, on every rank: the forward calls a module of another
                stage and cannot be traced.
        """
        self._settle(x)
        return self._run(self.schedule.step, x, y)

    @torch.no_grad()
    def evaluate(self, x: Any, y: Any) -> torch.Tensor | None:
        """Forward only; the mean loss on the last stage's rank, else ``None``. Gradients are
        left as they were.

        A traced split is traced again in eval mode (dropout off, batch-norm running statistics)
        at the first evaluation.
        """
        self._settle(x)
        schedule = self.schedule
        if self.traced:
            if self._eval_schedule is None:
                self._eval_schedule = self._traced_schedule(x, training=False, why=self._why)
            schedule = self._eval_schedule
        # torch's eval runs the step's end too, which divides every .grad by the micro-batches
        params = self.parameters()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        for m in self.modules:
            m.eval()
        try:
            return self._run(schedule.eval, x, y)
        finally:
            for m in self.modules:
                m.train()
            for p, g in zip(params, grads, strict=True):
                p.grad = g
