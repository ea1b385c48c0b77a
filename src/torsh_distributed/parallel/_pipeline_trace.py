"""Pipeline stages of a model whose forward does not skip ``None`` modules: a check, then tracing.

A pipeline split by module (:func:`~torsh_distributed.parallel.pipeline.stage_module`) runs the
model's own ``forward`` on each stage, with the modules of other stages set to ``None``; a forward
written the ordinary way (``return self.out(self.layers(self.stem(x)))``) calls one of them and
dies inside torch's schedule on one rank while its peers wait. Before the first step every rank
therefore runs :func:`check_forward`: each stage's pruned copy of a ``meta`` skeleton of the model
(no memory, no random numbers, no communication, the same answer on every rank) on the shape of
the first micro-batch. Reads of tensor values (``if h.mean() > 0``, ``.item()``) return 0 there,
so data-dependent Python control flow takes its "false" branch instead of failing. When a stage
calls a module that lives on another stage, the split is made instead by tracing
(:func:`traced_stages`: torch's ``pipeline()`` with ``SplitPoint.BEGINNING`` at the same split
points, through ``torch.export``), or, where tracing fails, every rank raises one line naming
the module and the tracing failure.

This module does not import :mod:`~torsh_distributed.parallel.pipeline` (which imports it): the
pruning function and the split are passed in.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import operator
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from torsh_distributed.parallel.pipeline import StageSplit

__all__ = [
    "CONVENTION",
    "ForwardCheck",
    "check_forward",
    "first_microbatch",
    "make_schedule",
    "meta_skeleton",
    "traced_stages",
]

Schedule = PipelineScheduleSingle | PipelineScheduleMulti
Prune = Callable[[nn.Module, int], nn.Module]

CONVENTION = (
    "write the forward to skip the modules that are None on a stage "
    "(`if self.out is not None`, docs/own-model.md)"
)

_MAX_SCALAR_READS = 10_000  # a `while h.norm() > eps` loop reads 0 and stops; this bounds the rest


def make_schedule(
    kind: str, stages: Sequence[_PipelineStageBase], microbatches: int, loss_fn: Callable[..., Any]
) -> Schedule:
    """torch's schedule ``kind`` (``gpipe``, ``1f1b``, ``interleaved``) over this rank's stages."""
    if kind == "interleaved":
        return ScheduleInterleaved1F1B(list(stages), microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(stages[0], microbatches, loss_fn=loss_fn)


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta`` (no data is copied)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(empty, requires_grad=tensor.requires_grad)
            if isinstance(tensor, nn.Parameter)
            else empty
        )
    return copy.deepcopy(model, memo)


def first_microbatch(x: Any, microbatches: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword inputs of the first micro-batch of input ``x``, as the
    schedule cuts it (dim 0 of every tensor)."""
    args, kwargs = split_args_kwargs_into_chunks((x,), None, microbatches)
    return args[0], kwargs[0]


def _to_meta(value: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


class _WrongStage(Exception):
    def __init__(self, module: str, home: int, *, attr: str | None = None, called: bool = True) -> None:
        super().__init__(module)
        self.module, self.home, self.called = module, home, called and attr is None
        self.name = module if attr is None else f"{module}.{attr}"


class _Absent(nn.Module):
    """Stands for a module of another stage in the diagnosing run: using it names it."""

    def __init__(self, name: str, home: int) -> None:
        super().__init__()
        self.absent_name, self.absent_home = name, home

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _WrongStage(self.absent_name, self.absent_home)

    def __getattr__(self, attr: str) -> Any:
        try:
            return super().__getattr__(attr)
        except AttributeError:
            raise _WrongStage(self.absent_name, self.absent_home, attr=attr) from None

    def _used(self, *args: Any) -> Any:  # iterated, indexed or measured (a container)
        raise _WrongStage(self.absent_name, self.absent_home, called=False)

    __iter__ = __getitem__ = __len__ = _used


class _ZeroScalars(TorchDispatchMode):
    """Tensor values read on ``meta`` (``bool(t)``, ``t.item()``) are 0 / ``False``."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.reads += 1
            if self.reads > _MAX_SCALAR_READS:
                raise RuntimeError(f"more than {_MAX_SCALAR_READS} reads of tensor values")
            dtype = args[0].dtype
            if func is torch.ops.aten.is_nonzero.default or dtype == torch.bool:
                return False
            return 0.0 if dtype.is_floating_point else 0
        return func(*args, **(kwargs or {}))


def _run_stage(stage: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch.no_grad(), torch.random.fork_rng(devices=[]), _ZeroScalars():
        return stage(*args, **kwargs)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {' '.join(text.splitlines()[0].split())}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def _model_line(exc: BaseException) -> str:
    """`` at FILE:LINE in FUNCTION``: the model's code that torch.export names in its message
    (its last frame outside torch), or ``""``."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [m for m in _FRAME.finditer(str(exc)) if not m.group(1).startswith(torch_dir)]
    if not frames:
        return ""
    path, line, func = frames[-1].groups()
    return f" at {path}:{line} in {func}"


@dataclass(frozen=True, slots=True)
class ForwardCheck:
    """What one run of every stage's pruned copy on ``meta`` showed (:func:`check_forward`)."""

    wrong_call: str | None = None
    """``"stage 0 of 2 called `out`, which lives on stage 1"``: the first use of a module of
    another stage (the forward does not skip ``None`` modules); ``None`` if there was none."""
    inconclusive: str | None = None
    """Why the check could not run a stage (an op without a ``meta`` kernel, ...), else ``None``."""

    @property
    def follows_convention(self) -> bool:
        return self.wrong_call is None and self.inconclusive is None


def _stand_ins(skeleton: nn.Module, pruned: nn.Module, split: StageSplit, skip: set[str]) -> None:
    """Put an :class:`_Absent` where ``pruned`` has ``None`` for a module of another stage, at
    each level of the container's path. The container's own missing entries stay missing: a
    stage iterating (or, as ``nn.Sequential``, calling) its container runs its entries only."""
    segs = split.container.split(".") if split.container else []
    last = split.num_stages - 1
    original, target, prefix = skeleton, pruned, ""
    for seg in segs:
        names = list(original._modules)
        here = names.index(seg)
        for i, name in enumerate(names):
            absent = target._modules.get(name) is None and original._modules[name] is not None
            if i != here and absent and f"{prefix}{name}" not in skip:
                target._modules[name] = _Absent(f"{prefix}{name}", 0 if i < here else last)
        nxt_original, nxt_target = original._modules[seg], target._modules[seg]
        assert nxt_original is not None and nxt_target is not None
        original, target, prefix = nxt_original, nxt_target, f"{prefix}{seg}."


_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")


def _site(exc: BaseException) -> tuple[str, int] | None:
    """File and line of the innermost frame of ``exc`` in the model's code (not in this file
    nor in ``nn.Module.__call__``): where the forward used the module."""
    site, tb = None, exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename != __file__ and not filename.endswith(_MODULE_CALL):
            site = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return site


def _diagnose(
    skeleton: nn.Module, split: StageSplit, prune: Prune, stage: int,
    args: tuple[Any, ...], kwargs: dict[str, Any], failure: BaseException,
) -> _WrongStage | None:
    """The module of another stage whose ``None`` the forward used at ``failure``: run ``stage``
    again with stand-ins for them, until one is used where ``failure`` happened. A stand-in used
    elsewhere was skipped by an ``is not None`` test in the real run: it stays ``None``."""
    site, skip = _site(failure), set[str]()
    while True:
        pruned = prune(skeleton, stage)
        _stand_ins(skeleton, pruned, split, skip)
        try:
            _run_stage(pruned, args, kwargs)
        except _WrongStage as exc:
            if _site(exc) == site:
                return exc
            skip.add(exc.module)  # never placed again: the loop ends
        except Exception:
            return None
        else:
            return None


def check_forward(
    skeleton: nn.Module,
    split: StageSplit,
    prune: Prune,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> ForwardCheck:
    """Run each stage's pruned copy of the ``meta`` skeleton on the first micro-batch, chained.

    Args:
        skeleton: :func:`meta_skeleton` of the whole model.
        split: The validated split.
        prune: ``stage_module(model, split, stage)`` as ``prune(model, stage)``.
        args: First stage's positional inputs (any device: moved to ``meta``).
        kwargs: Its keyword inputs.
    """
    args, kwargs = _to_meta(args), _to_meta(kwargs)
    for stage in range(split.num_stages):
        try:
            out = _run_stage(prune(skeleton, stage), args, kwargs)
        except Exception as exc:
            # only a use of None is a module of another stage (the stand-ins would also make a
            # forward that checks `is not None` call them)
            used_none = isinstance(exc, (TypeError, AttributeError)) and "NoneType" in str(exc)
            wrong = _diagnose(skeleton, split, prune, stage, args, kwargs, exc) if used_none else None
            if wrong is None:
                return ForwardCheck(inconclusive=f"stage {stage}: {_first_line(exc)}")
            verb = "called" if wrong.called else "used"
            return ForwardCheck(
                wrong_call=f"stage {stage} of {split.num_stages} {verb} `{wrong.name}`, which "
                f"lives on stage {wrong.home}"
            )
        args, kwargs = (tuple(out) if isinstance(out, (tuple, list)) else (out,)), {}
    return ForwardCheck()


def _unsupported(holder: nn.Module, skeleton: nn.Module) -> str | None:
    """What the transform of a stage module added that a traced graph would bypass, or ``None``
    (the model's own hooks and forwards are in the skeleton, and so in the traced graph)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in holder.parameters()):
        return "tensor parallelism or FSDP (parallel.tp > 1, parallel.zero_stage >= 2)"
    own = dict(skeleton.named_modules())
    for name, module in holder.named_modules():
        if type(module).__name__ == "CheckpointWrapper":
            return "activation checkpointing (parallel.activation_checkpointing)"
        if getattr(module, "_compiled_call_impl", None) is not None:
            return "torch.compile (parallel.compile)"
        original = own.get(name)
        where = name or "the model"
        if "forward" in module.__dict__ and (original is None or "forward" not in original.__dict__):
            return f"a replaced forward of {where} (autocast: parallel.param_dtype)"
        hooks = len(module._forward_hooks) + len(module._forward_pre_hooks)
        if original is not None and hooks > len(original._forward_hooks) + len(original._forward_pre_hooks):
            return f"forward hooks added to {where}"
    return None


def _bind(submod: nn.Module, holder: nn.Module, *, stage: int, num_stages: int, where: str) -> None:
    """Point the traced stage's parameters and buffers (``meta``) at the holder's, by name."""
    params = dict(holder.named_parameters(remove_duplicate=False))
    buffers = dict(holder.named_buffers(remove_duplicate=False))
    for module_name, module in submod.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for kind, table in (("_parameters", params), ("_buffers", buffers)):
            slots: dict[str, torch.Tensor | None] = getattr(module, kind)
            for leaf, tensor in slots.items():
                if tensor is None:
                    continue
                name = prefix + leaf
                if name not in table:
                    raise ValueError(
                        f"{where}: the traced stage {stage} of {num_stages} uses `{name}`, which "
                        "the split by module places on another stage (modules registered before "
                        "the container of blocks go to the first stage, after it to the last): "
                        f"register the modules in the order the forward calls them, or {CONVENTION}"
                    )
                slots[leaf] = table[name]
        leftover = [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and v.is_meta]
        if leftover:
            raise ValueError(
                f"{where}: the traced stage {stage} holds tensor attributes "
                f"{', '.join(prefix + k for k in leftover)} that are neither parameters nor "
                "buffers: register them as buffers"
            )


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Silence what torch.export says while we trace (a failure becomes our one line): its
    warnings, its shape logger, and the partial graph it prints to stderr when it fails (kept
    and written out if tracing succeeds)."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(printed):
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)
    sys.stderr.write(printed.getvalue())


def _check_adjacent(graph: torch.fx.Graph, *, why: str) -> None:
    """torch's schedules send a stage's outputs to the next stage only: refuse other routes."""
    calls = [n for n in graph.nodes if n.op == "call_module"]
    index = {n: i for i, n in enumerate(calls)}
    for i, node in enumerate(calls):
        for arg in node.all_input_nodes:
            while arg.op == "call_function" and arg.target is operator.getitem:
                arg = arg.args[0]
            source = index.get(arg, -1) if arg.op == "call_module" else -1
            if source != i - 1:
                origin = "the model's input" if source < 0 else f"stage {source}"
                raise ValueError(
                    f"{why}; the traced split passes a value from {origin} to stage {i} (a skip "
                    "connection around a stage), but torch's schedules send to the next stage "
                    f"only: choose split points that keep both ends of it on one stage, or {CONVENTION}"
                )


def traced_stages(
    skeleton: nn.Module,
    split: StageSplit,
    holders: Sequence[nn.Module],
    stage_ids: Sequence[int],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    device: torch.device,
    group: dist.ProcessGroup | None,
    training: bool,
    why: str,
) -> list[_PipelineStageBase]:
    """This rank's stages of the split of ``skeleton`` traced by torch (``pipeline()`` with
    ``SplitPoint.BEGINNING`` at ``split.split_points``), computing with ``holders``' tensors.

    Tracing runs on ``meta`` with the first micro-batch's shapes (stage shapes are fixed by it);
    each traced stage module's parameters and buffers are then replaced, by qualified name, by
    those of the holder of the same stage, so the optimizer, gradients and checkpoints are the
    holders'.

    Args:
        skeleton: :func:`meta_skeleton` of the whole model (copied, not changed).
        split: The validated split.
        holders: The pruned (and transformed) modules of ``stage_ids``.
        stage_ids: The stages this rank holds.
        args: First micro-batch positional inputs (moved to ``meta``).
        kwargs: Its keyword inputs.
        device: This rank's device (ops whose device tracing burned in move there).
        group: The ``pp`` process group.
        training: Trace in train mode (dropout, batch statistics) or eval mode.
        why: The start of the error message (the check's finding).

    Raises:
        ValueError: one line: ``why``, then why tracing cannot split the model.
    """
    try:
        from torch.distributed.pipelining import SplitPoint, pipeline
    except ImportError:  # pragma: no cover - torch >= 2.4 has both
        raise ValueError(f"{why}; this torch ({torch.__version__}) has no pipeline() to trace "
                         f"it with; {CONVENTION}") from None
    for sid, holder in zip(stage_ids, holders, strict=True):
        reason = _unsupported(holder, skeleton)
        if reason is not None:
            raise ValueError(
                f"{why}; a split by tracing runs each stage as a traced graph, which {reason} "
                f"cannot hook (stage {sid}): {CONVENTION} to combine them"
            )
    model = copy.deepcopy(skeleton).train(training)
    spec = {point: SplitPoint.BEGINNING for point in split.split_points}
    try:
        with torch.random.fork_rng(devices=[]), _quiet_export():
            pipe = pipeline(model, mb_args=_to_meta(args), mb_kwargs=_to_meta(kwargs) or None,
                            split_spec=spec)
    except Exception as exc:
        cause = exc.__cause__ or exc
        # from None: torch's pages of export diagnostics would bury the one line; its cause and
        # the model's line it names are in the message
        raise ValueError(
            f"{why}, and tracing the forward with torch.export to split it failed "
            f"({_first_line(cause)}{_model_line(cause)}); {CONVENTION}"
        ) from None
    if pipe.num_stages != split.num_stages:
        raise ValueError(
            f"{why}, and the traced forward splits into {pipe.num_stages} stages, not "
            f"{split.num_stages} (is a split point {split.split_points} called once per forward?); "
            f"{CONVENTION}"
        )
    _check_adjacent(pipe.split_gm.graph, why=why)
    stages: list[_PipelineStageBase] = []
    for sid, holder in zip(stage_ids, holders, strict=True):
        _bind(pipe.get_stage_module(sid), holder, stage=sid, num_stages=split.num_stages, where=why)
        stages.append(pipe.build_stage(sid, device, group))
    return stages
