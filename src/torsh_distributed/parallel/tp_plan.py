"""Tensor-parallel plans for user models: module patterns -> named styles, validated before use.

A plan maps module names to how each module is sharded over the ``tp`` mesh axis. Names are the
``named_modules()`` paths of the model, and ``*`` matches one path segment, so
``"layers.*.mlp.up"`` names the ``up`` projection of every layer. Styles are torch's DTensor
parallel styles, by name or given directly:

===================== ===============================================================================
``colwise``           ``nn.Linear`` output features (or ``nn.Embedding`` columns) split over ranks;
                      the output stays sharded on the last dim (feed it to a ``rowwise`` layer).
``rowwise``           ``nn.Linear`` input features split; the partial outputs are all-reduced to
                      one replicated output. After ``colwise`` this is Megatron's MLP pair.
``colwise_replicate`` ``colwise`` whose output is all-gathered (an output head without loss
                      parallelism).
``embedding``         vocabulary-parallel ``nn.Embedding``: rows split over ranks, the looked-up
                      rows all-reduced (torch's ``RowwiseParallel`` on an embedding).
``sequence``          norm / dropout run on sequence shards (``Shard(1)``); the neighbours must
                      use matching ``input_layouts`` / ``output_layouts`` (give styles directly).
===================== ===============================================================================

:func:`resolve_tp_plan` checks the plan against the model without any communication, so every
rank raises the same ``ValueError`` before any of them waits: a pattern that matches no module,
a module matched by two patterns, an unknown style, a style on a module type it cannot shard,
a dimension not divisible by the tensor-parallel degree, and whatever the plan's own ``check``
rejects. :func:`apply_tp_plan` then runs the plan's ``prepare`` step and calls torch's
``parallelize_module`` with the resolved plan.

A plan is the one way to shard a model over ``tp``, the built-in GPT included
(:func:`torsh_distributed.models.gpt_tp.gpt_tp_plan`). Besides its rules it says whether the
output logits stay sharded over the vocabulary (``loss_parallel``: the caller then computes the
loss and runs backward inside :func:`torch.distributed.tensor.parallel.loss_parallel`), and it
may carry a ``check`` (model-specific shape rules, run during validation) and a ``prepare``
step (a re-layout of parameters that styles cannot express, run just before sharding).

A pipeline stage holds only part of a model, so some patterns match nothing on it: validate the
plan strictly on the whole model, then apply it to each stage with ``strict=False``.

Modules whose forward reshapes by a head count (attention) must compute the local count from
the tensor's shape (``view(b, t, -1, head_dim)``), as with any DTensor plan: each rank holds
``n_head / tp`` heads after a ``colwise`` query/key/value projection. A fused ``qkv`` projection
needs its rows re-ordered first so each rank's shard holds its own heads of q, k and v: a
``prepare`` step applying :func:`torsh_distributed.parallel.tensor.qkv_permutation` (as the
built-in model's plan does).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["STYLES", "TPPlan", "resolve_tp_plan", "apply_tp_plan"]

STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_replicate": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence": SequenceParallel,
}

_NORMS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.Dropout,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """A tensor-parallel plan: ``{module pattern: style name or ParallelStyle}`` and its options.

    Raises (at construction):
        ValueError: an empty plan, an empty pattern, a style name not in :data:`STYLES`, a
            non-bool ``loss_parallel``, or a ``prepare`` / ``check`` that is not callable.
    """

    rules: Mapping[str, str | ParallelStyle] = field(default_factory=dict)
    """Module pattern (``*`` = one path segment) -> style name or ParallelStyle."""
    loss_parallel: bool = False
    """The plan leaves the output logits sharded over the vocabulary (a ``DTensor``, e.g. a head
    ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``): the caller must run
    the loss *and* backward inside :func:`torch.distributed.tensor.parallel.loss_parallel`, which
    computes the cross-entropy without gathering ``batch x seq x vocab`` logits (less memory and
    traffic). ``False``: the model returns whole plain logits (any loss works; a pipeline's last
    stage needs them)."""
    prepare: Callable[[nn.Module, int], None] | None = None
    """``prepare(module, tp)`` runs on the module (the whole model or a pipeline stage) after
    validation and before sharding, on every rank: a re-layout that styles cannot express, such
    as re-ordering a fused qkv projection's rows so that each rank's contiguous shard holds its
    own heads of q, k and v. It changes the module's ``state_dict`` layout (the caller converts
    checkpoints); ``None`` = nothing. Not run at ``tp = 1``. Must handle missing submodules
    (pipeline stages) and must not communicate."""
    check: Callable[[nn.Module, int], None] | None = None
    """``check(module, tp)`` raises ``ValueError`` for shapes the model cannot run sharded over
    ``tp`` ranks (e.g. ``tp`` must divide the attention heads), beyond the plan's own dimension
    checks; run by :func:`resolve_tp_plan` before any collective, also at ``tp = 1``, on the whole
    model or a stage. ``None`` = no extra rule."""

    def __post_init__(self) -> None:
        if not self.rules:
            raise ValueError("a TP plan needs at least one 'module pattern': 'style' entry")
        for pattern, style in self.rules.items():
            if not isinstance(pattern, str) or not pattern.strip():
                raise ValueError(f"TP plan patterns must be non-empty strings, got {pattern!r}")
            if isinstance(style, str) and style not in STYLES:
                raise ValueError(
                    f"TP plan entry {pattern!r}: unknown style {style!r}; choose one of "
                    f"{', '.join(STYLES)} or pass a torch ParallelStyle"
                )
            if not isinstance(style, (str, ParallelStyle)):
                raise ValueError(
                    f"TP plan entry {pattern!r}: style must be a name or a ParallelStyle, "
                    f"got {type(style).__name__}"
                )
        if not isinstance(self.loss_parallel, bool):
            raise ValueError(
                f"TPPlan.loss_parallel must be a bool, got {type(self.loss_parallel).__name__}"
            )
        for name in ("prepare", "check"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise ValueError(
                    f"TPPlan.{name} must be a function (module, tp) -> None or None, "
                    f"got {type(hook).__name__}"
                )


def _regex(pattern: str) -> re.Pattern[str]:
    parts = [
        ("[^.]+" if p == "*" else re.escape(p).replace(r"\*", "[^.]*")) for p in pattern.split(".")
    ]
    return re.compile(r"\.".join(parts) + r"\Z")


def _check_module(pattern: str, name: str, module: nn.Module, style: str, tp: int) -> None:
    where = f"TP plan entry {pattern!r} on {name!r} ({type(module).__name__})"
    if style == "sequence":
        if not isinstance(module, _NORMS):
            raise ValueError(f"{where}: 'sequence' applies to LayerNorm, RMSNorm or Dropout")
        return
    if isinstance(module, nn.Linear):
        dim, what = (
            (module.in_features, "in_features")
            if style == "rowwise"
            else (module.out_features, "out_features")
        )
        if style == "embedding":
            raise ValueError(f"{where}: 'embedding' applies to nn.Embedding; use 'colwise'")
    elif isinstance(module, nn.Embedding):
        if style == "colwise_replicate":
            raise ValueError(f"{where}: use 'colwise' or 'embedding' for an nn.Embedding")
        dim, what = (
            (module.num_embeddings, "num_embeddings")
            if style in ("rowwise", "embedding")
            else (module.embedding_dim, "embedding_dim")
        )
    else:
        raise ValueError(f"{where}: {style!r} applies to nn.Linear or nn.Embedding only")
    if dim % tp:
        raise ValueError(f"{where}: {what}={dim} is not divisible by tp={tp}")


def _check_instance(
    pattern: str, name: str, module: nn.Module, style: ParallelStyle, tp: int
) -> None:
    """Divisibility of a Linear / Embedding sharded by a given column- or row-wise style."""
    if isinstance(style, ColwiseParallel):
        kind = "colwise"
    elif isinstance(style, RowwiseParallel):
        kind = "embedding" if isinstance(module, nn.Embedding) else "rowwise"
    else:
        return
    if isinstance(module, (nn.Linear, nn.Embedding)):  # other types: torch's style decides
        _check_module(pattern, name, module, kind, tp)


def resolve_tp_plan(
    model: nn.Module,
    plan: TPPlan | Mapping[str, str | ParallelStyle],
    tp: int,
    *,
    strict: bool = True,
) -> dict[str, ParallelStyle]:
    """Expand ``plan``'s patterns over ``model`` and validate them for ``tp`` ranks (no collectives).

    Args:
        model: The whole model, or a pipeline stage of it (then ``strict=False``).
        plan: The plan (a mapping is taken as its ``rules``).
        tp: Tensor-parallel degree.
        strict: Every pattern must match a module. ``False`` skips patterns that match nothing
            (a pipeline stage holds only part of the model), which would also hide a typo:
            validate strictly on the whole model first.

    Returns:
        ``{module name: ParallelStyle}`` for ``parallelize_module``, in the model's module order
        (each module its own style object).

    Raises:
        ValueError: ``tp < 1``; whatever ``plan.check`` rejects; a pattern matching no module
            (``strict``; the message lists some names); a module matched twice; a style on a
            module it cannot shard; a sharded dimension not divisible by ``tp``.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    plan = plan if isinstance(plan, TPPlan) else TPPlan(rules=plan)
    if plan.check is not None:
        plan.check(model, tp)
    modules = [(n, m) for n, m in model.named_modules() if n]
    resolved: dict[str, ParallelStyle] = {}
    owner: dict[str, str] = {}
    for pattern, style in plan.rules.items():
        regex = _regex(pattern)
        hits = [(n, m) for n, m in modules if regex.match(n)]
        if not hits and strict:
            sample = ", ".join(n for n, _ in modules[:12])
            raise ValueError(
                f"TP plan entry {pattern!r} matches no module of {type(model).__name__} "
                f"(modules: {sample}{', ...' if len(modules) > 12 else ''})"
            )
        for name, module in hits:
            if name in owner:
                raise ValueError(
                    f"module {name!r} is matched by TP plan entries {owner[name]!r} and {pattern!r}"
                )
            owner[name] = pattern
            if isinstance(style, str):
                _check_module(pattern, name, module, style, tp)
                resolved[name] = STYLES[style]()
            else:
                _check_instance(pattern, name, module, style, tp)
                resolved[name] = copy.copy(style)  # parallelize_module sets attributes on it
    order = {n: i for i, (n, _) in enumerate(modules)}
    return dict(sorted(resolved.items(), key=lambda kv: order[kv[0]]))


def apply_tp_plan(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: TPPlan | Mapping[str, str | ParallelStyle],
    *,
    strict: bool = True,
) -> nn.Module:
    """Shard ``model`` over the 1-D tensor-parallel ``mesh`` by ``plan``, in place.

    The model must hold identical real parameters on every rank of ``mesh`` (build it under the
    same seed). Validation runs first on every rank (:func:`resolve_tp_plan`), so a bad plan
    raises before any collective. With ``mesh.size() == 1`` the model is returned unchanged
    (after validation). Otherwise ``plan.prepare`` runs, then torch's ``parallelize_module``.

    Args:
        model: The whole model, or a pipeline stage of it.
        mesh: The tensor-parallel mesh (e.g. ``ParallelDims.mesh["tp"]``).
        plan: The plan (a mapping is taken as its ``rules``).
        strict: See :func:`resolve_tp_plan`: ``False`` for a pipeline stage, after validating
            the plan strictly on the whole model.

    Returns:
        ``model``, its planned parameters now ``DTensor`` shards.

    Raises:
        ValueError: a mesh that is not 1-D, or a bad plan (see :func:`resolve_tp_plan`).
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_tp_plan needs a 1-D tensor-parallel mesh, got {mesh.ndim}-D")
    plan = plan if isinstance(plan, TPPlan) else TPPlan(rules=plan)
    tp = mesh.size()
    resolved = resolve_tp_plan(model, plan, tp, strict=strict)
    if tp == 1:
        return model
    if plan.prepare is not None:
        plan.prepare(model, tp)
    if not resolved:
        return model
    return parallelize_module(model, mesh, resolved)
