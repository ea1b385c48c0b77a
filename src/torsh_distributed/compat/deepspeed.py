"""DeepSpeed JSON configs on our engine: every key applied, mapped to an equivalent, or reported
unsupported; nothing silently ignored.

:func:`import_deepspeed` reads a DeepSpeed config (a path or a dict) and returns the
:class:`~torsh_distributed.engine.config.EngineConfig` (or subclass, e.g. the built-in trainer's
``TrainConfig``) it describes, on top of a base config, with a :class:`DeepSpeedReport` of what
happened to each key:

* **applied**: the same semantics here (``zero_optimization.stage`` -> ZeRO stage on
  ZeroRedundancyOptimizer / FSDP2, ``gradient_clipping``, AdamW's ``lr``/``betas``/``eps``, the
  batch triple, fp16's initial scale and window, bf16, the warm-up schedulers);
* **mapped**: an equivalent with a stated difference (``steps_per_print`` -> ``log_every``,
  DDP bucket sizes from element counts, ``overlap_comm`` -> torch overlaps anyway, a ``log``
  warm-up done linearly, ``OneBitAdam`` / ``ZeroOneAdam`` -> ``--optimizer onebit_adam |
  zerooneadam`` with their ``freeze_step`` / ``var_*`` / ``local_step_*`` parameters, ...);
* **unsupported**: no equivalent here (NVMe offload, ``hysteresis`` > 1, 1-bit LAMB, the
  profilers, DeepSpeed's own monitors, ...), and unknown keys, with a "did you mean" for
  misspellings. ``strict=True`` turns any unsupported key into a ``ValueError``;
* **default**: a key the config omits takes DeepSpeed's own default, not our preset's (a
  OneBitAdam without ``betas`` runs with (0.9, 0.999); no ``scheduler`` section keeps the
  learning rate constant; no ``gradient_clipping`` does not clip), with where DeepSpeed sets it
  (:mod:`._deepspeed_defaults`); a flag given explicitly on the command line wins over a
  default. A default we cannot honour (fp16's ``hysteresis`` 2) is reported unsupported;
* **ignored**: listed, never refused: comments (``_comment``, any key starting with ``_``, at
  any level: annotations, not settings) and a legacy ``bfloat16`` section next to a ``bf16`` one
  (DeepSpeed then reads only ``bf16``; alone, ``bfloat16`` is read exactly as ``bf16``).

``"auto"`` values resolve as Hugging Face's ``HfTrainerDeepSpeedConfig`` resolves them, from the
base config standing in for the trainer's arguments: micro-batch and accumulation from the
batch settings, ``lr``/``betas``/``eps``/``weight_decay`` from ``optim``, ``gradient_clipping``
from ``optim.grad_clip``, ``total_num_steps`` from ``max_steps``, ``fp16``/``bf16.enabled``
from ``parallel.param_dtype``, and the bucket sizes from the model's hidden size when given.

The batch triple follows DeepSpeed: ``train_batch_size = micro x accumulation x data-parallel
world``; any two determine the third; three inconsistent values are refused with the numbers.
``explicit`` (the settings a user gave on the command line) must not contradict the config:
a contradiction is refused, naming both (Hugging Face does the same).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from torsh_distributed.compat._deepspeed_defaults import apply_defaults
from torsh_distributed.compat._deepspeed_model_rules import (
    MODEL_RULES,
    MODEL_SECTIONS,
    autotp_size,
)
from torsh_distributed.compat._deepspeed_onebit_rules import ONEBIT_RULES
from torsh_distributed.compat._deepspeed_rules import RULES as _BASE_RULES
from torsh_distributed.compat._deepspeed_rules import SECTIONS as _BASE_SECTIONS
from torsh_distributed.compat._deepspeed_rules import Context, Outcome
from torsh_distributed.compat._report import ConfigReport, KeyReport, apply_changes, read_json
from torsh_distributed.engine.config import EngineConfig

__all__ = ["DeepSpeedReport", "KeyReport", "import_deepspeed", "load_deepspeed_json"]

C = TypeVar("C", bound=EngineConfig)
DeepSpeedReport = ConfigReport
"""The report of a DeepSpeed config (:class:`~._report.ConfigReport`)."""

RULES = {**_BASE_RULES, **MODEL_RULES, **ONEBIT_RULES}
SECTIONS = _BASE_SECTIONS | MODEL_SECTIONS
LEGACY_SECTIONS = {"bfloat16": "bf16"}
"""Old section names DeepSpeed still reads when the new name is absent (``get_bfloat16_config``)."""
COMMENT_NOTE = "a comment: keys starting with '_' are not settings"


def load_deepspeed_json(path: str | Path) -> dict[str, Any]:
    """Read a DeepSpeed JSON config; clear errors for a missing file or bad JSON."""
    return read_json(path, "DeepSpeed config")


def _leaves(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted keys of every leaf; a known section is descended into, any other dict is a leaf
    (reported as one unknown key)."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and (path in SECTIONS or path in LEGACY_SECTIONS):
            out.extend(_leaves(value, path + "."))  # an empty section has no keys to report
        else:
            out.append((path, value))
    return out


def _suggest(path: str) -> str:
    parent, _, name = path.rpartition(".")
    siblings = [
        k.rpartition(".")[2]
        for k in (*RULES, *SECTIONS)
        if k.rpartition(".")[0] == parent and "*" not in k
    ]
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.75)
    if close:
        full = f"{parent}.{close[0]}" if parent else close[0]
        return f"unknown key; did you mean {full!r}?"
    return "unknown key"


def _is_comment(path: str) -> bool:
    """``_comment``, ``zero_optimization._note``...: keys that only annotate a config."""
    return any(part.startswith("_") for part in path.split("."))


def _legacy(path: str, data: Mapping[str, Any]) -> tuple[str, str]:
    """``(the key DeepSpeed reads it as, why it is ignored)``: a key of a legacy section is read
    as its new name's key, unless the config also has the new section (then DeepSpeed reads only
    that one)."""
    section, dot, rest = path.partition(".")
    new = LEGACY_SECTIONS.get(section)
    if new is None or not dot:
        return path, ""
    if isinstance(data.get(new), dict):
        return path, f"DeepSpeed reads the {new!r} section when both {new!r} and {section!r} exist"
    return f"{new}.{rest}", ""


def _rule(path: str) -> Callable[[Any, Context], Outcome] | None:
    if path in RULES:
        return RULES[path]
    parent = path.rpartition(".")[0]
    while parent:  # a section whose every key shares one rule ("tensorboard.*")
        if f"{parent}.*" in RULES:
            return RULES[f"{parent}.*"]
        parent = parent.rpartition(".")[0]
    return None


def import_deepspeed(
    ds: Mapping[str, Any] | str | Path,
    base: C,
    *,
    world_size: int,
    explicit: Mapping[str, Any] | None = None,
    hidden_size: int | None = None,
    strict: bool = False,
) -> tuple[C, DeepSpeedReport]:
    """The config ``ds`` describes, on top of ``base``, and the report of every key.

    Args:
        ds: A DeepSpeed config (dict) or the path of its JSON file.
        base: The starting config (a preset, the command line's values); ``"auto"`` resolves
            from it.
        world_size: Ranks of the run (the data-parallel world is ``world_size / (tp * pp)``).
        explicit: Dotted settings the user gave explicitly (``{"optim.lr": 1e-3}``): a config
            value that contradicts one is refused.
        hidden_size: The model's hidden size, for the ``"auto"`` bucket sizes.
        strict: Refuse any unsupported key.

    Raises:
        ValueError: an inconsistent batch triple (with the numbers), a contradiction with an
            explicit setting, a wrong-typed value, or with ``strict`` an unsupported key (all
            of them listed).
    """
    data = load_deepspeed_json(ds) if isinstance(ds, (str, Path)) else dict(ds)
    settings = base.to_dict()
    par = settings["parallel"]
    tp = autotp_size(data) or par["tp"]  # the batch rules need the final dp world
    dp_world = world_size // max(tp * par["pp"], 1)
    ctx = Context(
        data=data,
        settings=settings,
        dp_world=dp_world,
        hidden_size=hidden_size,
        world_size=world_size,
    )
    report = ConfigReport("DeepSpeed config")
    for path, value in _leaves(data):
        if _is_comment(path):
            report.entries.append(KeyReport(path, value, "ignored", "", COMMENT_NOTE))
            continue
        read_as, shadowed = _legacy(path, data)
        if shadowed:
            report.entries.append(KeyReport(path, value, "ignored", "", shadowed))
            continue
        rule = _rule(read_as)
        hint = _suggest(read_as) if read_as not in RULES else ""
        if rule is None or "did you mean" in hint:  # unknown, or a misspelling of a known key
            report.entries.append(KeyReport(path, value, "unsupported", "", hint))
            continue
        out = rule(value, ctx)
        note = out.note
        if read_as != path:
            note = f"legacy name of {read_as}" + (f"; {note}" if note else "")
        report.entries.append(KeyReport(path, value, out.status, out.target, note))
    report.entries.extend(apply_defaults(ctx, _rule, explicit or {}))
    _finish_batch(ctx)  # the triple, once every key was seen
    report.entries.extend(KeyReport(k, v, "applied", t, n) for k, v, t, n in ctx.derived)
    _check_explicit(ctx.changes, explicit or {})
    report.check_strict(strict)
    return apply_changes(base, ctx.changes), report


def _finish_batch(ctx: Context) -> None:
    """Resolve train_batch_size = micro x accumulation x dp world (DeepSpeed's rule)."""
    w = ctx.dp_world
    # "auto" as Hugging Face resolves it: accumulation and micro-batch from the trainer's
    # settings (ours), the total derived from them
    if ctx.batch.get("accum") == -1:
        ctx.batch["accum"] = int(ctx.get("grad_accum"))
    if ctx.batch.get("micro") == -1:
        if ctx.batch.get("train", -1) == -1:
            ours = int(ctx.get("batch_size")) // max(int(ctx.get("grad_accum")) * w, 1)
            ctx.batch["micro"] = max(ours, 1)
        else:
            del ctx.batch["micro"]
    if ctx.batch.get("train") == -1:
        del ctx.batch["train"]
    tb, mb, ga = (ctx.batch.get(k) for k in ("train", "micro", "accum"))
    if tb is None and mb is None:
        if ga is not None:
            ctx.set("grad_accum", ga)
        return
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * w:
            raise ValueError(
                f"inconsistent DeepSpeed batch: train_batch_size {tb} != "
                f"train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps {ga} x "
                f"{w} data-parallel ranks = {mb * ga * w}"
            )
    elif tb is not None and mb is not None:
        ga, rest = divmod(tb, mb * w)
        if rest or ga < 1:
            raise ValueError(
                f"inconsistent DeepSpeed batch: train_batch_size {tb} is not a multiple of "
                f"train_micro_batch_size_per_gpu {mb} x {w} data-parallel ranks = {mb * w}"
            )
        ctx.derived.append(("gradient_accumulation_steps (derived)", ga, "grad_accum", ""))
    elif tb is not None:
        ga = ga or 1
        mb, rest = divmod(tb, ga * w)
        if rest or mb < 1:
            raise ValueError(
                f"inconsistent DeepSpeed batch: train_batch_size {tb} is not a multiple of "
                f"gradient_accumulation_steps {ga} x {w} data-parallel ranks = {ga * w}"
            )
    else:
        assert mb is not None
        ga = ga or 1
        tb = mb * ga * w
        ctx.derived.append(("train_batch_size (derived)", tb, "batch_size", ""))
    ctx.set("batch_size", tb)
    ctx.set("grad_accum", ga)


def _check_explicit(changes: Mapping[str, Any], explicit: Mapping[str, Any]) -> None:
    conflicts = [
        f"--{target.replace('_', '-')} {explicit[target]} vs {value} from the DeepSpeed config"
        for target, value in changes.items()
        if target in explicit and explicit[target] != value
    ]
    if conflicts:
        raise ValueError(
            "the DeepSpeed config contradicts settings given on the command line: "
            + "; ".join(conflicts)
            + ' (drop one, or set the key to "auto")'
        )
