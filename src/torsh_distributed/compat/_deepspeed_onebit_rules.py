"""DeepSpeed's communication-compressing optimizers (``OneBitAdam``, ``ZeroOneAdam``) and their
parameters on our ``--optimizer onebit_adam | zerooneadam`` (see :mod:`.deepspeed`).

``optimizer.type`` is decided here for these two types and by the base rule for every other;
their parameters apply only under their own type (a ``freeze_step`` under ``AdamW`` is
reported unsupported, as DeepSpeed would ignore it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torsh_distributed.compat._deepspeed_rules import Context, Outcome, _int, _optimizer_type

__all__ = ["ONEBIT_RULES"]

Rule = Callable[[Any, Context], Outcome]

_TYPES = {"onebitadam": "onebit_adam", "zerooneadam": "zerooneadam"}
_DIFFERENCE = (
    "AdamW's bias correction and decoupled weight decay; 1-bit codes carry one scale per 64 "
    "entries (DeepSpeed: one per tensor)"
)


def _kind(ctx: Context) -> str:
    return _TYPES.get(str(ctx.section("optimizer").get("type", "")).lower(), "")


def _type(value: Any, ctx: Context) -> Outcome:
    kind = _TYPES.get(str(value).lower())
    if kind is None:
        out = _optimizer_type(value, ctx)
        if out.status != "unsupported":
            return out
        kept = ctx.get("optim.optimizer")
        return Outcome(
            "unsupported",
            out.target,
            f"{value}: only Adam, AdamW, SGD, OneBitAdam and ZeroOneAdam; keeping {kept}",
        )
    ctx.set("optim.optimizer", kind)
    name = "1-bit Adam" if kind == "onebit_adam" else "0/1 Adam"
    return Outcome("mapped", "optim.optimizer", f"{name} with {_DIFFERENCE}")


def _param(target: str, owner: str) -> Rule:
    """An integer parameter of ``owner`` (our optimizer name) applied to ``target``."""

    def rule(value: Any, ctx: Context) -> Outcome:
        if _kind(ctx) != owner:
            return Outcome("unsupported", "", f"a parameter of {_owner_name(owner)} only")
        if value == "auto":
            return Outcome("applied", target, f"auto -> {ctx.get(target)}")
        number = _int(f"optimizer.params.{target.rpartition('.')[2]}", value)
        if number < 1:
            raise ValueError(f"DeepSpeed optimizer.params: {target} must be >= 1, got {number}")
        ctx.set(target, number)
        return Outcome("applied", target)

    return rule


def _owner_name(owner: str) -> str:
    return "OneBitAdam" if owner == "onebit_adam" else "ZeroOneAdam"


def _backend_note(what: str) -> Rule:
    def rule(value: Any, ctx: Context) -> Outcome:
        if not _kind(ctx):
            return Outcome("unsupported", "", "a parameter of OneBitAdam / ZeroOneAdam only")
        return Outcome("mapped", "", what)

    return rule


def _eps_inside_sqrt(value: Any, ctx: Context) -> Outcome:
    if value in (False, None):
        return Outcome("applied", "", "off, as here")
    return Outcome("unsupported", "", "epsilon inside the square root is not built")


def _max_grad_norm(value: Any, ctx: Context) -> Outcome:
    if value in (0, 0.0, None):
        return Outcome("applied", "", "off, as DeepSpeed's 1-bit optimizers leave it")
    return Outcome("unsupported", "", "clip with gradient_clipping (optim.grad_clip)")


ONEBIT_RULES: dict[str, Rule] = {
    "optimizer.type": _type,
    "optimizer.params.freeze_step": _param("optim.freeze_step", "onebit_adam"),
    "optimizer.params.var_freeze_step": _param("optim.freeze_step", "zerooneadam"),
    "optimizer.params.var_update_scaler": _param("optim.var_update_scaler", "zerooneadam"),
    "optimizer.params.local_step_scaler": _param("optim.local_step_scaler", "zerooneadam"),
    "optimizer.params.local_step_clipper": _param("optim.local_step_clipper", "zerooneadam"),
    "optimizer.params.cuda_aware": _backend_note(
        "torch.distributed carries the codes (no CUDA-aware MPI needed)"
    ),
    "optimizer.params.comm_backend_name": _backend_note(
        "the process group's backend (--backend: gloo or nccl)"
    ),
    "optimizer.params.eps_inside_sqrt": _eps_inside_sqrt,
    "optimizer.params.max_grad_norm": _max_grad_norm,
}
