"""Pipeline parallelism of any model, cut at split points named by module, on ``torch.distributed.pipelining``.

A model is cut into ``pp * virtual_stages`` stages at *split points*: the qualified names of
entries of ONE container of repeated blocks (an ``nn.ModuleList``, ``nn.ModuleDict`` or
``nn.Sequential``, possibly nested: ``layers.4``, ``transformer.h.3``, or ``"2"`` for an
``nn.Sequential`` model), each the first entry of a stage after the first. Without split points
the container of blocks is found (:func:`~torsh_distributed.parallel.blocks.find_blocks`: the
longest container whose entries share one type) and split evenly (:func:`even_split_points`).

Each stage is a copy of the whole model pruned to its part (torchtitan's
``pipeline_module_split``, generalised):

* the container keeps only the stage's entries, under their ORIGINAL keys (``layers`` of stage 1
  holds ``"4" .. "7"``, not ``"0" .. "3"``), so a stage's ``named_parameters()`` are the unsplit
  model's names and the stages' state dicts together are the whole model's: a checkpoint written
  by all pipeline ranks loads at another pipeline degree, or without one;
* modules registered BEFORE the container (at every level of its path: the root's, and those of
  each ancestor) stay on the first stage only, those registered AFTER it on the last stage only;
  elsewhere they are set to ``None``.

The forward contract. The model's ``forward`` must skip the modules set to ``None``, iterate its
container (not index it by position, nor read its length as the model's depth), and return a
tensor from every stage: the first stage is called with the batch input, every other stage with
the previous stage's output, and the last stage's output goes to ``loss_fn(output, target)``::

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, 64)     # before `layers`: first stage only
            self.layers = nn.ModuleList(Block() for _ in range(8))
            self.norm = nn.LayerNorm(64)           # after `layers`: last stage only
            self.head = nn.Linear(64, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x) if self.embed is not None else x
            for layer in self.layers:              # this stage's entries only
                h = layer(h)
            h = self.norm(h) if self.norm is not None else h
            return self.head(h) if self.head is not None else h

    runner = build_pipeline(Net(), split_points=["layers.4"], pp_rank=rank, pp=2, group=None,
                            device=device, microbatches=4, loss_fn=F.cross_entropy)

An ``nn.Sequential`` model needs nothing: its forward runs the entries a stage holds.

A forward written the ordinary way (``return self.head(self.layers(self.embed(x)))``) is found
at the first :meth:`PipelineRunner.step`, before any communication, by running every stage's
pruned copy of a ``meta`` skeleton of the model on the first micro-batch's shapes (the same on
every rank). Such a model is split instead by tracing (torch's ``pipeline()`` at the same split
points, through ``torch.export``; the traced stages compute with the pruned copies' parameters,
so optimizer, gradients and checkpoints are unchanged), or, where tracing fails, every rank
raises one ``ValueError`` line naming the module called on the wrong stage and the tracing
failure (:mod:`~torsh_distributed.parallel._pipeline_trace`). Parameters
or buffers held directly by the root or an ancestor of the container (not by a child module)
belong to no stage and are rejected, as are weights tied across stages (nothing would keep the
copies equal).

Rank ``r`` of the ``pp`` axis holds stages ``r, r + pp, r + 2 pp, ...`` (one with GPipe and 1F1B,
``virtual_stages`` with interleaved 1F1B). The batch of a data-parallel rank is cut into
``microbatches`` equal micro-batches; ``loss_fn`` is the per-micro-batch loss and torch's schedule
scales gradients by ``1 / microbatches``, so with a mean loss, loss and gradients equal those of
the unsplit model on the same batch.

Every set-up that cannot run is rejected by :func:`check_pipeline` (schedule and micro-batches)
and :func:`check_split_points` (the split), pure functions that every rank evaluates on the same
inputs before the first collective: all ranks raise the same ``ValueError`` instead of some
waiting on a peer that has failed.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.parallel.blocks import CONTAINERS as _CONTAINERS
from torsh_distributed.parallel.blocks import block_entries, find_blocks

if TYPE_CHECKING:
    # torch.distributed.pipelining imports torch._dynamo (seconds per rank): imported by
    # build_pipeline, so that a run with pp=1 never pays it (issue 37)
    from torch.distributed.pipelining import PipelineStage

    from torsh_distributed.parallel._pipeline_runner import PipelineRunner

__all__ = [
    "SCHEDULES",
    "PipelineRunner",
    "StageSplit",
    "build_pipeline",
    "check_pipeline",
    "check_split_points",
    "even_split_points",
    "stage_ids",
    "stage_module",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")

_KINDS = "nn.ModuleList, nn.ModuleDict or nn.Sequential"


def check_pipeline(
    *,
    pp: int,
    schedule: str,
    microbatches: int,
    virtual_stages: int,
    batch_size: int,
) -> None:
    """Reject schedules the set-up cannot run, identically on every rank, before any collective.

    The split of the model is checked by :func:`check_split_points`.

    Args:
        pp: Pipeline degree (ranks on the ``pp`` axis).
        schedule: ``gpipe``, ``1f1b`` or ``interleaved``.
        microbatches: Micro-batches per step.
        virtual_stages: Stages per rank (``interleaved`` only; 1 otherwise).
        batch_size: Samples per step on one data-parallel rank (cut into micro-batches).

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
    if batch_size % microbatches:
        raise ValueError(
            f"the per-data-parallel-rank batch {batch_size} is not divisible by "
            f"parallel.microbatches={microbatches}"
        )


def stage_ids(pp_rank: int, *, pp: int, virtual_stages: int) -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank`` (looped placement: ``r, r + pp, ...``)."""
    return [pp_rank + pp * j for j in range(virtual_stages)]


@dataclass(frozen=True, slots=True)
class StageSplit:
    """A validated cut of a model into pipeline stages (see :func:`check_split_points`)."""

    container: str | None
    """Qualified name of the container of blocks (``""``: the model itself); ``None`` when there
    is one stage, the whole model."""
    stages: tuple[tuple[str, ...], ...]
    """The container's entry keys held by each stage, in order."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def split_points(self) -> list[str]:
        """Qualified name of the first entry of each stage after the first."""
        return [_qualify(self.container or "", keys[0]) for keys in self.stages[1:]]


def _qualify(container: str, key: str) -> str:
    return f"{container}.{key}" if container else key


def _describe(container: str) -> str:
    return f"{container!r}" if container else "the model"


def _entry_range(container: str, keys: Sequence[str]) -> str:
    names = [_qualify(container, k) for k in keys]
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} .. {names[-1]}"


def even_split_points(model: nn.Module, num_stages: int) -> list[str]:
    """Split points cutting ``model``'s container of blocks into ``num_stages`` equal stages.

    The container is the longest ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential`` whose
    entries share one type (:func:`~torsh_distributed.parallel.blocks.find_blocks`). An even
    split balances the blocks, not the whole stages: the first stage also runs what comes before
    the container (embeddings), the last what comes after (norm, head); give split points to
    lighten them.

    Raises:
        ValueError: no such container, or its length is not a multiple of ``num_stages``.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1; got {num_stages}")
    try:
        name, container = find_blocks(model)
    except ValueError as exc:
        raise ValueError(
            f"cannot split {type(model).__name__} evenly into {num_stages} pipeline stages: "
            f"{exc}; give split points (parallel.pp_split) instead"
        ) from None
    keys = [k for k, _ in block_entries(container)]
    if len(keys) % num_stages:
        raise ValueError(
            f"the {len(keys)} entries of {_describe(name)} ({_entry_range(name, keys)}) do not "
            f"split evenly into {num_stages} pipeline stages; give split points "
            f"(parallel.pp_split) or a number of stages that divides {len(keys)}"
        )
    per = len(keys) // num_stages
    return [_qualify(name, keys[i * per]) for i in range(1, num_stages)]


def _names_hint(model: nn.Module, name: str) -> str:
    """`` (entries of 'layers': layers.0 .. layers.7)``: the valid names nearest to ``name``."""
    prefix, found = name, None
    while prefix and found is None:
        prefix = prefix.rpartition(".")[0]
        with contextlib.suppress(AttributeError):
            module = model.get_submodule(prefix)
            found = module if isinstance(module, _CONTAINERS) else None
    if found is None:
        try:
            prefix, found = find_blocks(model)
        except ValueError:
            children = [n for n, m in model.named_children() if m is not None]
            return f" (its children: {', '.join(children)})"
    keys = [k for k, _ in block_entries(found)]
    return f" (entries of {_describe(prefix)}: {_entry_range(prefix, keys)})"


def _locate(model: nn.Module, point: object) -> tuple[str, str]:
    """``(container name, entry key)`` of one split point."""
    cls = type(model).__name__
    if not isinstance(point, str):
        raise TypeError(
            f"pp split points are module names like 'layers.4'; got {point!r} "
            f"({type(point).__name__})"
        )
    if not point:
        raise ValueError(f"pp split point '' is {cls} itself, not an entry of a container")
    try:
        module = model.get_submodule(point)
    except AttributeError:
        raise ValueError(
            f"pp split point {point!r} names no module of {cls}{_names_hint(model, point)}"
        ) from None
    parent_name, _, key = point.rpartition(".")
    parent = model.get_submodule(parent_name)
    if not isinstance(parent, _CONTAINERS) or parent._modules.get(key) is not module:
        raise ValueError(
            f"pp split point {point!r} is not an entry of a container ({_KINDS}): "
            f"{_describe(parent_name)} is a {type(parent).__name__}{_names_hint(model, point)}"
        )
    return parent_name, key


def _path(model: nn.Module, container: str) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` from the root down to the container, both included."""
    out: list[tuple[str, nn.Module]] = [("", model)]
    for seg in container.split(".") if container else []:
        child = out[-1][1]._modules[seg]
        assert child is not None, f"{container!r} passes through a None module"
        out.append((_qualify(out[-1][0], seg), child))
    return out


def _check_direct_state(model: nn.Module, container: str) -> None:
    held = [
        _qualify(prefix, n)
        for prefix, module in _path(model, container)
        for n, t in [*module._parameters.items(), *module._buffers.items()]
        if t is not None
    ]
    if held:
        raise ValueError(
            f"{type(model).__name__} holds parameters or buffers directly on the path to its "
            f"container of blocks {_describe(container)}: {', '.join(map(repr, held))}. A pipeline "
            "split places child modules on stages and cannot place these: move them into a "
            "submodule registered before the container (first stage) or after it (last stage)"
        )


def _stage_of(name: str, split: StageSplit, order: list[list[str]]) -> int:
    """Stage holding parameter ``name`` (``order``: the children's names at each path level)."""
    segs = name.split(".")
    path = split.container.split(".") if split.container else []
    last = split.num_stages - 1
    for level, seg in enumerate(path):
        if segs[level] != seg:
            names = order[level]
            return 0 if names.index(segs[level]) < names.index(seg) else last
    key = segs[len(path)]
    return next(i for i, keys in enumerate(split.stages) if key in keys)


def _check_tied(model: nn.Module, split: StageSplit) -> None:
    order = [list(m._modules) for _, m in _path(model, split.container or "")]
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        stages = sorted({_stage_of(n, split, order) for n in names})
        if len(stages) > 1:
            raise ValueError(
                f"parameter {' = '.join(map(repr, names))} of {type(model).__name__} is shared "
                f"by stages {', '.join(map(str, stages))} of the pipeline split "
                f"{split.split_points}: weights tied across stages would drift apart; untie "
                "them or choose split points that keep them on one stage"
            )


def check_split_points(
    model: nn.Module, split_points: Sequence[str] | None, *, num_stages: int
) -> StageSplit:
    """Validate a pipeline split of ``model`` without communicating (every rank, same error).

    Args:
        model: The whole model (may be on ``meta``).
        split_points: The first entry of each stage after the first, ``num_stages - 1`` entries
            of one container of blocks in increasing order (``["layers.4"]``); ``None`` = an even
            split (:func:`even_split_points`).
        num_stages: ``pp * virtual_stages``.

    Returns:
        The resolved split.

    Raises:
        ValueError: a name names no module, or not an entry of a container; the names are in
            different containers, not strictly increasing, or start at the first entry (stage 0
            would hold none); their count is not ``num_stages - 1``; the model holds parameters
            or buffers directly on the container's path, or ties weights across stages.
        TypeError: a split point is not a string.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1; got {num_stages}")
    if split_points is None:
        if num_stages == 1:
            return StageSplit(container=None, stages=((),))
        points = even_split_points(model, num_stages)
    else:
        points = list(split_points)
    if len(points) != num_stages - 1:
        raise ValueError(
            f"pp split points {points} name {len(points)} modules; {num_stages} pipeline stages "
            f"(pp x virtual_stages) need {num_stages - 1}"
        )
    if num_stages == 1:
        return StageSplit(container=None, stages=((),))
    located = [_locate(model, p) for p in points]
    containers = {c for c, _ in located}
    if len(containers) > 1:
        where = ", ".join(f"{p!r} in {_describe(c)}" for p, (c, _) in zip(points, located, strict=True))
        raise ValueError(
            f"pp split points must be entries of one container of blocks; got {where}"
        )
    container = located[0][0]
    keys = [k for k, _ in block_entries(model.get_submodule(container))]
    idx = [keys.index(k) for _, k in located]
    if idx[0] == 0:
        raise ValueError(
            f"pp split point {points[0]!r} is the first entry of {_describe(container)}: stage 0 "
            "would be empty (split points name the first entry of stages 1, 2, ...)"
        )
    if any(b <= a for a, b in pairwise(idx)):
        raise ValueError(
            f"pp split points {points} must be strictly increasing in the order of "
            f"{_describe(container)} ({_entry_range(container, keys)}): every stage needs an entry"
        )
    _check_direct_state(model, container)
    bounds = [0, *idx, len(keys)]
    split = StageSplit(
        container=container,
        stages=tuple(tuple(keys[a:b]) for a, b in pairwise(bounds)),
    )
    _check_tied(model, split)
    return split


def stage_module(model: nn.Module, split: StageSplit, stage: int) -> nn.Module:
    """A copy of ``model`` pruned to ``stage`` of ``split`` (the module docstring says how).

    Only what the stage keeps is copied (the pruned modules are detached from ``model`` during
    the copy and put back), so building a stage of a materialised model costs that stage's
    memory, not the whole model's. ``model`` is unchanged.

    Args:
        model: The whole model ``split`` was validated on.
        split: From :func:`check_split_points`.
        stage: Index in ``[0, split.num_stages)``.
    """
    if not 0 <= stage < split.num_stages:
        raise ValueError(f"stage {stage} is not in [0, {split.num_stages})")
    if split.container is None:
        return copy.deepcopy(model)
    first, last = stage == 0, stage == split.num_stages - 1
    path = _path(model, split.container)
    pruned: list[tuple[nn.Module, str, nn.Module]] = []
    for (_, parent), (child_name, _) in pairwise(path):
        key = child_name.rpartition(".")[2]
        names = list(parent._modules)
        here = names.index(key)
        for i, name in enumerate(names):
            keep = (i < here and first) or (i > here and last) or i == here
            if not keep and parent._modules[name] is not None:
                pruned.append((parent, name, parent._modules[name]))
    container = path[-1][1]
    held = set(split.stages[stage])
    pruned += [(container, k, m) for k, m in container._modules.items() if k not in held]
    try:
        for parent, name, _ in pruned:
            parent._modules[name] = None
        out = copy.deepcopy(model)
    finally:
        for parent, name, module in pruned:
            parent._modules[name] = module
    out_container = out.get_submodule(split.container)
    for key in [k for k, m in out_container._modules.items() if m is None]:
        del out_container._modules[key]  # keys are kept, not renumbered: names stay global
    return out


def build_pipeline(
    model: nn.Module,
    *,
    split_points: Sequence[str] | None,
    pp_rank: int,
    pp: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    schedule: str = "1f1b",
    microbatches: int,
    virtual_stages: int = 1,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    transform: Callable[[nn.Module], nn.Module] | None = None,
) -> PipelineRunner:
    """Cut ``model`` into stages at ``split_points``, build this rank's, and their schedule.

    Args:
        model: The whole model, identical on every rank. Its forward skips ``None`` modules (the
            contract of the module docstring: split by module), or not (split by tracing at the
            first step, :attr:`PipelineRunner.traced`). It is not changed; this rank's stages are
            pruned copies (drop your reference to free the rest; on ``meta`` a copy costs
            nothing), plus a ``meta`` skeleton kept until the first step.
        split_points: The first entry of each stage after the first (``pp * virtual_stages - 1``
            names in one container: ``["layers.4"]``), e.g. to lighten the first or last stage,
            which also run the embeddings or the head; ``None`` = an even split of the container
            of blocks (its length must then divide evenly).
        pp_rank: This rank's index on the ``pp`` axis.
        pp: Pipeline degree.
        group: The ``pp`` axis process group (``ParallelDims.group("pp")``); ``None`` = world.
        device: This rank's device.
        schedule: ``gpipe`` (all forwards, then all backwards: stashes ``microbatches``
            activations), ``1f1b`` (at most ``pp`` in flight, same bubble) or ``interleaved``
            (``virtual_stages`` per rank: the bubble shrinks by ``virtual_stages``, more messages).
        microbatches: Micro-batches per step; more shrink the bubble ``(p-1)/(m+p-1)`` but make
            each smaller (less efficient kernels).
        virtual_stages: Stages per rank (interleaved only).
        loss_fn: ``loss_fn(output, target)`` of one micro-batch, on the last stage's output; a
            mean makes loss and gradients those of the unsplit model on the whole batch.
        transform: Applied to each pruned stage module before it is wrapped in a
            ``PipelineStage`` (tensor parallelism, FSDP, activation checkpointing of the stage);
            it may return another module. Stage shapes are inferred at the first step, so
            activations may be DTensors or sequence shards.

    Raises:
        ValueError: see :func:`check_pipeline` and :func:`check_split_points` (the batch size is
            checked at :meth:`PipelineRunner.step` by torch; a forward that can be neither split
            by module nor traced, at the first :meth:`PipelineRunner.step`, on every rank).
    """
    from torch.distributed.pipelining import PipelineStage

    from torsh_distributed.parallel._pipeline_runner import Deferred, PipelineRunner
    from torsh_distributed.parallel._pipeline_trace import make_schedule, meta_skeleton

    num_stages = pp * virtual_stages
    check_pipeline(
        pp=pp,
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        batch_size=microbatches,
    )
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is not in [0, pp={pp})")
    split = check_split_points(model, split_points, num_stages=num_stages)
    ids = stage_ids(pp_rank, pp=pp, virtual_stages=virtual_stages)
    deferred = None
    if split.container is not None and type(model) is not nn.Sequential:
        deferred = Deferred(
            skeleton=meta_skeleton(model), name=type(model).__name__, schedule=schedule,
            microbatches=microbatches, loss_fn=loss_fn, device=device, group=group, stage_ids=ids,
            prune=lambda m, s: stage_module(m, split, s),
        )
    modules: list[nn.Module] = []
    stages: list[PipelineStage] = []
    for sid in ids:
        module = stage_module(model, split, sid)
        if transform is not None:
            module = transform(module)
        modules.append(module)
        stages.append(PipelineStage(module, sid, num_stages, device, group=group))
    runner = make_schedule(schedule, stages, microbatches, loss_fn)
    return PipelineRunner(stages, modules, runner, split=split, deferred=deferred)


def __getattr__(name: str) -> Any:
    # PEP 562: the re-export of PipelineRunner imports torch.distributed.pipelining on first use
    if name == "PipelineRunner":
        from torsh_distributed.parallel._pipeline_runner import PipelineRunner

        return PipelineRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
