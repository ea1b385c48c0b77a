"""DeepSpeed's own defaults for the keys a config omits (see :mod:`.deepspeed`).

A key a DeepSpeed config leaves out takes DeepSpeed's default, not our preset's: a OneBitAdam
without ``betas`` runs with (0.9, 0.999), a config without ``scheduler`` keeps the learning rate
constant, one without ``gradient_clipping`` does not clip. Each such key is run through the same
rule as a written one (so a default we cannot honour, fp16's ``hysteresis`` 2, is reported
unsupported) and listed in the report as ``default``. A setting given explicitly on the command
line wins over a default (the config says nothing that contradicts it); the report says so.

Where each default comes from (DeepSpeed at 38327e0, Feb 2025, and torch 2.x):

* ``deepspeed/runtime/constants.py``: ``GRADIENT_CLIPPING_DEFAULT = 0.``,
  ``FP16_ENABLED_DEFAULT = False``, ``BFLOAT16_ENABLED_DEFAULT = False``,
  ``FP16_INITIAL_SCALE_POWER_DEFAULT = 16``, ``FP16_LOSS_SCALE_WINDOW_DEFAULT = 1000``,
  ``FP16_HYSTERESIS_DEFAULT = 2``, ``FP16_MIN_LOSS_SCALE_DEFAULT = 1``; the batch triple's missing
  ``gradient_accumulation_steps`` is 1 (``DeepSpeedConfig._set_batch_related_parameters``).
* ``deepspeed/runtime/zero/config.py``: ``DeepSpeedZeroConfig.stage = 0`` (no ZeRO).
* ``deepspeed/runtime/compiler.py``: ``CompileConfig.enabled = False``.
* ``deepspeed/runtime/engine.py`` ``_configure_basic_optimizer``: ``Adam`` / ``AdamW`` are
  ``FusedAdam`` (``deepspeed/ops/adam/fused_adam.py``: ``lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
  weight_decay=0.``; ``DeepSpeedCPUAdam`` under CPU offload has the same), or with
  ``torch_adam: true`` torch's ``AdamW`` (``weight_decay=0.01``); ``SGD`` is torch's
  (``lr=1e-3, momentum=0, weight_decay=0``); ``OneBitAdam`` / ``ZeroOneAdam`` are
  ``deepspeed/runtime/fp16/onebit/adam.py`` / ``zoadam.py`` (``lr=1e-3, betas=(0.9, 0.999),
  eps=1e-8, weight_decay=0.``, ``freeze_step`` / ``var_freeze_step=100000``,
  ``var_update_scaler=16``, ``local_step_scaler=32678``, ``local_step_clipper=16``).
* ``engine.py`` ``_scheduler_from_config``: no ``scheduler`` section, no scheduler: the
  optimizer's learning rate stays constant, without warm-up.
* ``deepspeed/runtime/lr_schedules.py``: ``WarmupLR`` / ``WarmupDecayLR(warmup_min_lr=0.0,
  warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type='log')`` (``warmup_max_lr`` replaces
  the optimizer's ``lr``: the scheduler writes every param group's lr), ``WarmupCosineLR(
  warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001, warmup_type='log')``; their
  ``total_num_steps`` has no default (DeepSpeed fails without it; here the run's ``max_steps``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torsh_distributed.compat._deepspeed_rules import Context, Outcome, Rule
from torsh_distributed.compat._report import KeyReport

__all__ = ["apply_defaults"]

_SKIP = object()
"""A default that does not apply to this config (its section or type is absent)."""

_ADAM = {"adam", "adamw", "onebitadam", "zerooneadam"}
_ONEBIT = {"onebitadam", "zerooneadam"}


@dataclass(frozen=True, slots=True)
class _Default:
    key: str
    value: Callable[[Context], Any]
    """DeepSpeed's default for this config, or ``_SKIP`` where the key does not apply."""
    source: str
    """Where DeepSpeed (or torch) sets it: shown in the report's note."""
    rule: Rule | None = None
    """How the default applies, when not the written key's rule."""


def _opt_type(ctx: Context) -> str:
    return str(ctx.section("optimizer").get("type", "")).lower()


def _scheduler_type(ctx: Context) -> str:
    return str(ctx.section("scheduler").get("type", "")).lower()


def _for_optimizers(kinds: set[str], value: Any) -> Callable[[Context], Any]:
    return lambda ctx: value if _opt_type(ctx) in kinds else _SKIP


def _for_schedulers(kinds: set[str], value: Any) -> Callable[[Context], Any]:
    return lambda ctx: value if _scheduler_type(ctx) in kinds else _SKIP


def _weight_decay(ctx: Context) -> Any:
    kind = _opt_type(ctx)
    if kind == "sgd" or kind in _ONEBIT:
        return 0.0
    if kind not in _ADAM:
        return _SKIP
    torch_adam = ctx.section("optimizer").get("params", {}).get("torch_adam") is True
    return 0.01 if torch_adam and kind == "adamw" else 0.0


def _fp16_on(ctx: Context) -> bool:
    enabled = ctx.section("fp16").get("enabled", False)
    return enabled is True or (enabled == "auto" and ctx.get("parallel.param_dtype") == "fp16")


def _when_fp16(value: Any) -> Callable[[Context], Any]:
    return lambda ctx: value if _fp16_on(ctx) else _SKIP


def _precision_unset(ctx: Context) -> Any:
    """Neither fp16 nor bf16 (nor the legacy bfloat16) says ``enabled``: DeepSpeed runs fp32."""
    said = any("enabled" in ctx.section(s) for s in ("fp16", "bf16", "bfloat16"))
    return _SKIP if said else False


def _fp32(value: Any, ctx: Context) -> Outcome:
    ctx.set("parallel.param_dtype", "fp32")
    return Outcome("applied", "parallel.param_dtype", "fp32 compute")


def _compile_unset(ctx: Context) -> Any:
    section = ctx.section("compile")
    return _SKIP if "enabled" in section or "disable" in section else False


def _compile_off(value: Any, ctx: Context) -> Outcome:
    ctx.set("parallel.compile", False)
    return Outcome("applied", "parallel.compile", "compile off")


def _no_optimizer(ctx: Context) -> Any:
    return _SKIP if isinstance(ctx.data.get("optimizer"), dict) else None


def _client_optimizer(value: Any, ctx: Context) -> Outcome:
    o = {k: ctx.get(f"optim.{k}") for k in ("optimizer", "lr", "beta1", "beta2", "weight_decay")}
    return Outcome(
        "applied",
        "optim",
        "no optimizer section: DeepSpeed steps the client's optimizer "
        "(deepspeed.initialize(optimizer=...)); here the command line's, "
        + ", ".join(f"{k} {v}" for k, v in o.items()),
    )


def _no_scheduler(ctx: Context) -> Any:
    return _SKIP if isinstance(ctx.data.get("scheduler"), dict) else None


def _constant_lr(value: Any, ctx: Context) -> Outcome:
    ctx.set("optim.schedule", "constant")
    ctx.set("optim.warmup_steps", 0)
    return Outcome(
        "applied",
        "optim.schedule/warmup_steps",
        "no scheduler section: DeepSpeed keeps the optimizer's lr constant, without warm-up",
    )


def _total_steps(ctx: Context) -> Any:
    if _scheduler_type(ctx) not in ("warmupdecaylr", "warmupcosinelr"):
        return _SKIP
    return ctx.get("max_steps")


def _keep_max_steps(value: Any, ctx: Context) -> Outcome:
    return Outcome(
        "mapped", "max_steps", "required by DeepSpeed (no default): the decay ends at max_steps"
    )


def _batch_accum(ctx: Context) -> Any:
    keys = {"train_batch_size", "train_micro_batch_size_per_gpu"}
    return 1 if 0 < len(keys & ctx.data.keys()) < 2 else _SKIP


_WARMUP = {"warmuplr", "warmupdecaylr", "warmupcosinelr"}
_FUSED = "FusedAdam / torch.optim defaults"
_LR_SCHEDULES = "deepspeed/runtime/lr_schedules.py"
_FP16 = "deepspeed/runtime/constants.py FP16_*_DEFAULT"

DEFAULTS: tuple[_Default, ...] = (
    _Default("gradient_accumulation_steps", _batch_accum, "DeepSpeedConfig: 1 when not derived"),
    _Default("gradient_clipping", lambda ctx: 0.0, "GRADIENT_CLIPPING_DEFAULT: no clipping"),
    _Default("zero_optimization.stage", lambda ctx: 0, "DeepSpeedZeroConfig.stage"),
    _Default("fp16.enabled", _precision_unset, "FP16_ENABLED_DEFAULT", _fp32),
    _Default("bf16.enabled", _precision_unset, "BFLOAT16_ENABLED_DEFAULT", _fp32),
    _Default("fp16.initial_scale_power", _when_fp16(16), _FP16),
    _Default("fp16.loss_scale_window", _when_fp16(1000), _FP16),
    _Default("fp16.hysteresis", _when_fp16(2), _FP16),
    _Default("fp16.min_loss_scale", _when_fp16(1), _FP16),
    _Default("compile.enabled", _compile_unset, "CompileConfig.enabled", _compile_off),
    _Default("optimizer", _no_optimizer, "engine._configure_optimizer", _client_optimizer),
    _Default("optimizer.params.lr", _for_optimizers(_ADAM | {"sgd"}, 1e-3), _FUSED),
    _Default("optimizer.params.betas", _for_optimizers(_ADAM, [0.9, 0.999]), _FUSED),
    _Default("optimizer.params.eps", _for_optimizers(_ADAM, 1e-8), _FUSED),
    _Default("optimizer.params.weight_decay", _weight_decay, _FUSED + " (torch AdamW: 0.01)"),
    _Default("optimizer.params.momentum", _for_optimizers({"sgd"}, 0.0), "torch.optim.SGD"),
    _Default(
        "optimizer.params.freeze_step", _for_optimizers({"onebitadam"}, 100000), "OnebitAdam"
    ),
    _Default(
        "optimizer.params.var_freeze_step",
        _for_optimizers({"zerooneadam"}, 100000),
        "ZeroOneAdam",
    ),
    _Default(
        "optimizer.params.var_update_scaler", _for_optimizers({"zerooneadam"}, 16), "ZeroOneAdam"
    ),
    _Default(
        "optimizer.params.local_step_scaler",
        _for_optimizers({"zerooneadam"}, 32678),
        "ZeroOneAdam",
    ),
    _Default(
        "optimizer.params.local_step_clipper", _for_optimizers({"zerooneadam"}, 16), "ZeroOneAdam"
    ),
    _Default("scheduler", _no_scheduler, "engine._scheduler_from_config", _constant_lr),
    _Default(
        "scheduler.params.warmup_min_lr",
        _for_schedulers({"warmuplr", "warmupdecaylr"}, 0.0),
        _LR_SCHEDULES,
    ),
    _Default(
        "scheduler.params.warmup_max_lr",
        _for_schedulers({"warmuplr", "warmupdecaylr"}, 0.001),
        _LR_SCHEDULES + "; it replaces the optimizer's lr",
    ),
    _Default(
        "scheduler.params.warmup_min_ratio",
        _for_schedulers({"warmupcosinelr"}, 0.0),
        _LR_SCHEDULES,
    ),
    _Default("scheduler.params.warmup_num_steps", _for_schedulers(_WARMUP, 1000), _LR_SCHEDULES),
    _Default("scheduler.params.warmup_type", _for_schedulers(_WARMUP, "log"), _LR_SCHEDULES),
    _Default(
        "scheduler.params.cos_min_ratio",
        _for_schedulers({"warmupcosinelr"}, 0.0001),
        _LR_SCHEDULES,
    ),
    _Default("scheduler.params.total_num_steps", _total_steps, "no default", _keep_max_steps),
)
"""Every default, in the order the report lists them; only keys that change a setting here."""


def _present(data: Mapping[str, Any], dotted: str) -> bool:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


_MISSING = object()


def apply_defaults(
    ctx: Context, rules: Callable[[str], Rule | None], explicit: Mapping[str, Any]
) -> list[KeyReport]:
    """Apply DeepSpeed's default of every key ``ctx.data`` omits; one report entry each.

    ``rules`` finds the rule of a written key; a change to a setting in ``explicit`` (given on
    the command line) is undone, and the entry says the command line's value was kept.
    """
    entries: list[KeyReport] = []
    for default in DEFAULTS:
        value = default.value(ctx)
        if value is _SKIP or _present(ctx.data, default.key):
            continue
        rule = default.rule or rules(default.key)
        assert rule is not None, default.key
        before = dict(ctx.changes)
        out = rule(value, ctx)
        kept = []
        for target in [t for t, v in ctx.changes.items() if before.get(t, _MISSING) != v]:
            if target in explicit:
                flag = f"--{target.replace('_', '-')} {explicit[target]}"
                kept.append(f"{flag} kept (given on the command line)")
                if target in before:
                    ctx.changes[target] = before[target]
                else:
                    del ctx.changes[target]
        note = f"omitted: DeepSpeed's default ({default.source})"
        note += "".join(f"; {part}" for part in (kept or [out.note]) if part)
        status = "unsupported" if out.status == "unsupported" else "default"
        entries.append(KeyReport(default.key, value, status, out.target, note))
    return entries
