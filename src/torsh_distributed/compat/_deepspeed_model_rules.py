"""DeepSpeed keys about how the model computes: activation checkpointing, ``compile``, AutoTP's
``tensor_parallel`` and bf16's low-precision master state (see :mod:`.deepspeed`).

Each rule follows DeepSpeed's own semantics, read from its sources and docs:

* ``activation_checkpointing`` only *configures* ``deepspeed.checkpointing.checkpoint()``;
  DeepSpeed recomputes exactly where the model's code calls that function, so the section alone
  recomputes nothing. None of its keys turns recomputation on here either (that is
  ``--ac full`` / ``every-K``).
* ``compile.enabled`` (older releases' ``CompileConfig``: ``enabled``, ``backend``, ``kwargs``)
  compiles the model with ``torch.compile`` (so does the legacy ``disable: false`` of the
  pull request that introduced the section, #4878); the other ``compile`` keys configure DeepCompile,
  which only runs after the user calls ``engine.compile()``.
* ``tensor_parallel.autotp_size`` is AutoTP's tensor-parallel degree (0 or 1: off); the
  data-parallel world becomes ``world_size / autotp_size``.
* ``bf16.bf16_master_weights_and_grads`` / ``bf16_optimizer_states`` keep the master copy in
  bf16 instead of fp32.
"""

from __future__ import annotations

from typing import Any

from torsh_distributed.compat._deepspeed_rules import Context, Outcome, Rule, _off_or

__all__ = ["AC_NOTE", "MODEL_RULES", "MODEL_SECTIONS", "autotp_size"]

AC_NOTE = (
    "configures deepspeed.checkpointing.checkpoint(): DeepSpeed recomputes only where the model "
    "calls it, so the section alone recomputes nothing; nor does it here (recompute blocks with "
    "--ac full or every-K)"
)
"""Why no ``activation_checkpointing`` key changes ``parallel.activation_checkpointing``."""


def _ac(feature: str | None) -> Rule:
    """A key of ``activation_checkpointing``: off (or a size) is nothing to do; a feature of
    DeepSpeed's ``checkpoint()`` switched on is not built here."""

    def rule(value: Any, ctx: Context) -> Outcome:
        if feature is None or value in (False, None, "auto"):
            return Outcome("mapped", "", AC_NOTE)
        return Outcome(
            "unsupported",
            "",
            f"{feature} in deepspeed.checkpointing.checkpoint() is not built (no recomputation "
            "is turned on here by this section: --ac full or every-K)",
        )

    return rule


# -- compile ----------------------------------------------------------------------------------
def _deepcompile_on(ctx: Context) -> bool:
    return ctx.section("compile").get("deepcompile") is True


def _compile_enabled(value: Any, ctx: Context) -> Outcome:
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed compile.enabled must be true or false, got {value!r}")
    if not value:
        return Outcome("applied", "", "compile off")
    ctx.set("parallel.compile", True)
    return Outcome(
        "mapped",
        "parallel.compile",
        "torch.compile of each block (after activation checkpointing, before FSDP/DDP); "
        "DeepSpeed compiled the whole module at its first forward",
    )


def _compile_disable(value: Any, ctx: Context) -> Outcome:
    """The name of ``compile`` in DeepSpeed PR #4878's description and early branch
    (``{"disable": false, "backend": "inductor"}``), copied into configs; it was released as
    ``enabled``. ``disable: false`` means compile."""
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed compile.disable must be true or false, got {value!r}")
    enabled = ctx.section("compile").get("enabled")
    if isinstance(enabled, bool) and enabled == value:
        raise ValueError(
            f"DeepSpeed compile.enabled {str(enabled).lower()} contradicts the legacy "
            f"compile.disable {str(value).lower()}: drop compile.disable"
        )
    if value:
        return Outcome("applied", "", "legacy name: disable true = compile off")
    ctx.set("parallel.compile", True)
    out = _compile_enabled(True, ctx)
    return Outcome(out.status, out.target, f"legacy name: disable false = enabled true; {out.note}")


def _compile_backend(value: Any, ctx: Context) -> Outcome:
    if value == "inductor":
        return Outcome("applied", "", "torch.compile's default backend, as here")
    return Outcome("unsupported", "", f"backend {value!r}: blocks compile with inductor here")


def _compile_kwargs(value: Any, ctx: Context) -> Outcome:
    if value in ({}, None):
        return Outcome("applied", "", "no torch.compile options")
    return Outcome(
        "unsupported", "", "torch.compile options are not configurable here (its defaults)"
    )


def _deepcompile(value: Any, ctx: Context) -> Outcome:
    if value in (False, None):
        return Outcome("applied", "", "DeepCompile off, as here")
    return Outcome(
        "unsupported",
        "",
        "DeepCompile (DeepSpeed's graph passes for ZeRO-3, run by engine.compile()) is not "
        "built; compile.enabled / --compile compiles each block with torch.compile",
    )


def _deepcompile_setting(value: Any, ctx: Context) -> Outcome:
    if _deepcompile_on(ctx):
        return Outcome("unsupported", "", "a DeepCompile setting: DeepCompile is not built")
    return Outcome("mapped", "", "a DeepCompile setting; deepcompile is off: nothing to do")


# -- tensor parallelism -----------------------------------------------------------------------
def autotp_size(data: dict[str, Any]) -> int | None:
    """AutoTP's degree in a config when it turns tensor parallelism on (> 1), else ``None``."""
    section = data.get("tensor_parallel")
    size = section.get("autotp_size") if isinstance(section, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 1:
        return None
    return size


def _autotp_size(value: Any, ctx: Context) -> Outcome:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"DeepSpeed tensor_parallel.autotp_size must be an integer >= 0, got {value!r}"
        )
    if value <= 1:
        return Outcome("applied", "", f"{value}: AutoTP off, no tensor parallelism")
    pp = int(ctx.get("parallel.pp"))
    if ctx.world_size % (value * pp):
        raise ValueError(
            f"DeepSpeed tensor_parallel.autotp_size {value} (x pp {pp}) does not divide the "
            f"{ctx.world_size} ranks of the run"
        )
    ctx.set("parallel.tp", value)
    ctx.dp_world = ctx.world_size // (value * pp)
    return Outcome(
        "mapped",
        "parallel.tp",
        "AutoTP shards the linear layers it recognises; here the model's TP plan shards them "
        "(the built-in GPT's, or --tp-plan for your model: docs/own-model.md); "
        f"data-parallel ranks = {ctx.world_size} / {value * pp}",
    )


MODEL_RULES: dict[str, Rule] = {
    "activation_checkpointing.partition_activations": _ac(
        "partitioning checkpointed activations over model-parallel ranks"
    ),
    "activation_checkpointing.cpu_checkpointing": _ac("offloading checkpoints to the host"),
    "activation_checkpointing.contiguous_memory_optimization": _ac(
        "copying checkpoints into one contiguous buffer"
    ),
    "activation_checkpointing.number_checkpoints": _ac(None),
    "activation_checkpointing.synchronize_checkpoint_boundary": _ac(
        "synchronizing the device at checkpoint boundaries"
    ),
    "activation_checkpointing.profile": _ac("profiling checkpoint() (use --monitor)"),
    "compile.enabled": _compile_enabled,
    "compile.disable": _compile_disable,
    "compile.backend": _compile_backend,
    "compile.kwargs": _compile_kwargs,
    "compile.deepcompile": _deepcompile,
    "compile.*": _deepcompile_setting,
    "tensor_parallel.autotp_size": _autotp_size,
    "tensor_parallel.tp_overlap_comm": _off_or(
        "overlapping tensor-parallel communication with compute is not built"
    ),
    "tensor_parallel.keep_module_on_host": _off_or("sharding from host memory is not built"),
    "tensor_parallel.*": _off_or(
        "an AutoTP setting with no equivalent here (the model's TP plan decides the sharding)"
    ),
    "bf16.bf16_master_weights_and_grads": _off_or(
        "master weights and gradients stay fp32 here (bf16 is the compute dtype only)"
    ),
    "bf16.bf16_optimizer_states": _off_or("optimizer states stay fp32 here"),
}
"""Rules of the keys this module covers (merged with :data:`._deepspeed_rules.RULES`)."""

MODEL_SECTIONS = frozenset({"activation_checkpointing", "compile", "tensor_parallel"})
"""Sections of these keys that are descended into."""
