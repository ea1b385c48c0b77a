"""Pipeline parallelism of the built-in transformer on ``torch.distributed.pipelining``.

The model is split by layer count (or at explicit split points) into ``pp * virtual_stages``
stages: the first stage also holds the embeddings, the last the final norm and the head. Rank ``r`` of the ``pp`` axis holds stages
``r, r + pp, r + 2 pp, ...`` (one with GPipe and 1F1B, ``virtual_stages`` with interleaved 1F1B).
The global batch of a data-parallel rank is cut into ``microbatches`` equal micro-batches; the
loss function is the per-micro-batch mean cross-entropy and torch's schedule scales gradients by
``1 / microbatches``, so loss and gradients equal those of the unsplit model on the same batch.

Every set-up the schedules cannot run is rejected by :func:`check_pipeline`, a pure function that
every rank evaluates on the same inputs before the first collective: all ranks raise the same
``ValueError`` instead of some waiting on a peer that has failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

__all__ = [
    "SCHEDULES",
    "GPTStage",
    "PipelineRunner",
    "build_pipeline",
    "check_pipeline",
    "check_split_points",
    "stage_layers",
    "stage_ids",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def check_pipeline(
    *,
    pp: int,
    schedule: str,
    microbatches: int,
    virtual_stages: int,
    n_layer: int,
    batch_size: int,
) -> None:
    """Reject pipeline set-ups that cannot run, identically on every rank, before any collective.

    Args:
        pp: Pipeline degree (ranks on the ``pp`` axis).
        schedule: ``gpipe``, ``1f1b`` or ``interleaved``.
        microbatches: Micro-batches per step.
        virtual_stages: Stages per rank (``interleaved`` only; 1 otherwise).
        n_layer: Transformer blocks of the model.
        batch_size: Sequences per step on one data-parallel rank (cut into micro-batches).

    Raises:
        ValueError: naming the setting and what it must be.
    """
    if schedule not in SCHEDULES:
        raise ValueError(
            f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}"
        )
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            f"parallel.pp, microbatches and virtual_stages must be >= 1; got pp={pp}, "
            f"microbatches={microbatches}, virtual_stages={virtual_stages}"
        )
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError(
            "parallel.pp_schedule=interleaved needs parallel.virtual_stages >= 2 (stages per rank)"
        )
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"parallel.virtual_stages={virtual_stages} needs parallel.pp_schedule=interleaved; "
            f"{schedule} runs one stage per rank"
        )
    if schedule in ("1f1b", "interleaved") and microbatches < pp:
        raise ValueError(
            f"parallel.microbatches={microbatches} is fewer than the {pp} pipeline stages; "
            f"{schedule} needs microbatches >= pp (GPipe does not)"
        )
    if schedule == "interleaved" and microbatches % pp:
        raise ValueError(
            f"parallel.microbatches={microbatches} must be a multiple of pp={pp} for interleaved 1F1B"
        )
    num_stages = pp * virtual_stages
    if n_layer % num_stages:
        raise ValueError(
            f"model.n_layer={n_layer} is not divisible into {num_stages} pipeline stages "
            f"(pp={pp} x virtual_stages={virtual_stages}); choose n_layer a multiple of {num_stages}"
        )
    if batch_size % microbatches:
        raise ValueError(
            f"the per-data-parallel-rank batch {batch_size} is not divisible by "
            f"parallel.microbatches={microbatches}"
        )


def stage_ids(pp_rank: int, *, pp: int, virtual_stages: int) -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank`` (looped placement: ``r, r + pp, ...``)."""
    return [pp_rank + pp * j for j in range(virtual_stages)]


def stage_layers(
    stage: int, *, num_stages: int, n_layer: int, split_points: Sequence[int] | None = None
) -> range:
    """Block indices of ``stage``: an even split of ``n_layer`` blocks, or explicit split points.

    ``split_points`` are the first block of stages ``1 .. num_stages - 1`` (``[1, 3]`` cuts 4
    blocks into ``[0] [1, 2] [3]``); see :func:`check_split_points`.
    """
    if split_points is None:
        per = n_layer // num_stages
        return range(stage * per, (stage + 1) * per)
    bounds = [0, *split_points, n_layer]
    return range(bounds[stage], bounds[stage + 1])


def check_split_points(split_points: Sequence[int], *, num_stages: int, n_layer: int) -> None:
    """``split_points`` must be ``num_stages - 1`` strictly increasing blocks in ``[1, n_layer)``.

    Raises:
        ValueError: naming the split points and what they must be.
    """
    points = list(split_points)
    if len(points) != num_stages - 1:
        raise ValueError(
            f"split_points {points} must give {num_stages - 1} boundaries for {num_stages} stages"
        )
    bounds = [0, *points, n_layer]
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(
            f"split_points {points} must be strictly increasing within [1, {n_layer}) so that "
            f"every stage holds at least one block"
        )


class GPTStage(nn.Module):
    """A contiguous slice of a GPT: ``[embeddings] blocks[start:stop] [ln_f, head]``.

    Shares (does not copy) the submodules of the model it was cut from, so parameter values are
    exactly those of the unsplit model.
    """

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.layer_ids = list(layers)
        if first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        if self.last:
            return self.head(self.ln_f(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (the unsplit model's loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class PipelineRunner:
    """The stages this rank holds and the schedule that runs them; one :meth:`step` per batch."""

    def __init__(
        self,
        stages: list[PipelineStage],
        modules: list[GPTStage],
        schedule: PipelineScheduleSingle | PipelineScheduleMulti,
    ) -> None:
        self.stages, self.modules, self.schedule = stages, modules, schedule
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

    def parameters(self) -> list[nn.Parameter]:
        """Parameters of this rank's stages (each once)."""
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def state_module(self) -> nn.Module:
        """This rank's stages under the unsplit GPT's names (``tok_emb``, ``blocks.<global
        index>``, ``ln_f``, ``head``), for checkpoints.

        Each pipeline rank's state dict then holds disjoint names of the one model, so a DCP
        checkpoint written by all ranks is the whole model, loadable at another pipeline degree
        (or none). The stage modules' own names (``blocks.0`` on every stage) would collide.
        """
        view = nn.Module()
        blocks = nn.ModuleDict()
        for m in self.modules:
            for i, block in zip(m.layer_ids, m.blocks, strict=True):
                blocks[str(i)] = block
            if m.first:
                view.tok_emb, view.pos_emb = m.tok_emb, m.pos_emb
            if m.last:
                view.ln_f, view.head = m.ln_f, m.head
        view.blocks = blocks
        return view

    def _run(
        self, run: Callable[..., object], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor | None:
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

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch (gradients accumulate into the stages' ``.grad``).

        Returns:
            The batch's mean loss on the rank holding the last stage, else ``None``.
        """
        return self._run(self.schedule.step, x, y)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Forward only; the mean loss on the last stage's rank, else ``None``."""
        for m in self.modules:
            m.eval()
        try:
            return self._run(self.schedule.eval, x, y)
        finally:
            for m in self.modules:
                m.train()


def build_pipeline(
    model: nn.Module,
    *,
    pp_rank: int,
    pp: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    schedule: str = "1f1b",
    microbatches: int,
    virtual_stages: int = 1,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    transform: Callable[[GPTStage], nn.Module] | None = None,
    split_points: Sequence[int] | None = None,
) -> PipelineRunner:
    """Cut ``model`` into stages, keep this rank's, and build the schedule.

    Args:
        model: The whole GPT, identical on every rank (unused stages are dropped by the caller's
            reference going away; build big models on ``meta`` instead when memory matters).
        pp_rank: This rank's index on the ``pp`` axis.
        pp: Pipeline degree.
        group: The ``pp`` axis process group (``ParallelDims.group("pp")``).
        device: This rank's device.
        schedule: ``gpipe`` (all forwards, then all backwards: stashes ``microbatches``
            activations), ``1f1b`` (at most ``pp`` in flight, same bubble) or ``interleaved``
            (``virtual_stages`` per rank: bubble shrinks by ``virtual_stages``, more messages).
        microbatches: Micro-batches per step; more shrink the bubble ``(p-1)/(m+p-1)`` but make
            each smaller (less efficient kernels).
        virtual_stages: Stages per rank (interleaved only).
        loss_fn: ``loss_fn(logits, targets)`` of one micro-batch.
        transform: Applied to each stage module before it is wrapped (e.g. tensor parallelism).
        split_points: First block of each stage after the first (``pp * virtual_stages - 1``
            values) for uneven splits, e.g. a lighter last stage that also runs the head;
            ``None`` = split by layer count (``n_layer`` must then divide evenly).

    Raises:
        ValueError: see :func:`check_pipeline` (``batch_size`` is checked at :meth:`step` by torch).
    """
    n_layer = len(model.blocks)
    num_stages = pp * virtual_stages
    if split_points is not None:
        check_split_points(split_points, num_stages=num_stages, n_layer=n_layer)
    check_pipeline(
        pp=pp,
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        n_layer=num_stages if split_points is not None else n_layer,
        batch_size=microbatches,
    )
    modules: list[GPTStage] = []
    stages: list[PipelineStage] = []
    for sid in stage_ids(pp_rank, pp=pp, virtual_stages=virtual_stages):
        module = GPTStage(
            model,
            stage_layers(sid, num_stages=num_stages, n_layer=n_layer, split_points=split_points),
            first=sid == 0,
            last=sid == num_stages - 1,
        )
        if transform is not None:
            module = transform(module)
        modules.append(module)
        stages.append(PipelineStage(module, sid, num_stages, device, group=group))
    if schedule == "interleaved":
        runner = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        runner = cls(stages[0], microbatches, loss_fn=loss_fn)
    return PipelineRunner(stages, modules, runner)
