"""FairScale sharding configs on our ZeRO stages, with the applied/mapped/unsupported report.

FairScale is unmaintained; its three sharding wrappers map onto torch's own sharding here:

============================  =============================================  ===========
FairScale                     here                                           ZeRO stage
============================  =============================================  ===========
``OSS`` (optimizer sharding)  ``ZeroRedundancyOptimizer`` over DDP           1
``ShardedDataParallel``       FSDP2 without resharding after forward         2
``FullyShardedDataParallel``  FSDP2, ``reshard_after_forward`` as given       3 (2 if False)
============================  =============================================  ===========

Input: a JSON object naming the wrappers with their constructor arguments, e.g.
``{"OSS": {"optim": "AdamW", "lr": 1e-3}, "ShardedDataParallel": {"reduce_fp16": true}}`` or
``{"FullyShardedDataParallel": {"mixed_precision": true, "reshard_after_forward": false}}``,
or the ``distributed_training`` / ``common`` / ``optimization`` sections of a fairseq config (how
fairseq checkpoints record their FairScale set-up: ``ddp_backend: fully_sharded``,
``zero_sharding: os``, ...). :func:`import_fairscale` returns the engine config and a
:class:`~._report.ConfigReport`; ``strict=True`` refuses unsupported keys.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from torsh_distributed.compat._report import ConfigReport, KeyReport, apply_changes, read_json
from torsh_distributed.engine.config import EngineConfig

__all__ = ["import_fairscale"]

C = TypeVar("C", bound=EngineConfig)
Out = tuple[str, str, str]  # status, target, note
Rule = Callable[[Any, dict[str, Any]], Out]

_DTYPES = {
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
}
_OPTIMIZERS = {"sgd": "sgd", "adam": "adamw", "adamw": "adamw"}


def _set(target: str, convert: Callable[[Any], Any] = lambda v: v, note: str = "") -> Rule:
    def rule(value: Any, changes: dict[str, Any]) -> Out:
        changes[target] = convert(value)
        return ("mapped" if note else "applied", target, note)

    return rule


def _only(expected: Any, why: str, note: str = "") -> Rule:
    """Supported at ``expected`` (our behaviour), unsupported otherwise."""

    def rule(value: Any, changes: dict[str, Any]) -> Out:
        if value == expected:
            return ("mapped" if note else "applied", "", note or "our behaviour")
        return ("unsupported", "", why)

    return rule


def _when(target: str, value: Any, off: str, note: str = "") -> Rule:
    """A boolean that, when true, sets ``target`` to ``value``."""

    def rule(flag: Any, changes: dict[str, Any]) -> Out:
        if flag:
            changes[target] = value
            return ("applied", target, note)
        return ("applied", "", off)

    return rule


def _zero_sharding(value: Any, changes: dict[str, Any]) -> Out:
    if value == "os":
        changes["parallel.zero_stage"] = 1
        return ("applied", "parallel.zero_stage", "OSS -> ZeroRedundancyOptimizer")
    if value in ("none", None):
        return ("applied", "", "no optimizer sharding")
    return ("unsupported", "", f"zero_sharding {value!r}")


def _no_reshard(value: Any, changes: dict[str, Any]) -> Out:
    if changes.get("parallel.zero_stage", 0) >= 2:
        return _reshard(not value, changes)
    return ("mapped", "", "applies to ddp_backend fully_sharded only")


def _mapped(note: str) -> Rule:
    return lambda value, changes: ("mapped", "", note)


def _unsupported(why: str) -> Rule:
    return lambda value, changes: ("unsupported", "", why)


def _optim(value: Any, changes: dict[str, Any]) -> Out:
    name = str(value).rsplit(".", 1)[-1].lower()
    if name not in _OPTIMIZERS:
        return ("unsupported", "optim.optimizer", f"{value}: only SGD, Adam and AdamW")
    changes["optim.optimizer"] = _OPTIMIZERS[name]
    return (
        "mapped" if name == "adam" else "applied",
        "optim.optimizer",
        "Adam runs as AdamW (decoupled decay)" if name == "adam" else "",
    )


def _betas(value: Any, changes: dict[str, Any]) -> Out:
    changes["optim.beta1"], changes["optim.beta2"] = (float(v) for v in value)
    return ("applied", "optim.beta1/beta2", "")


_OPTIMIZER_KEYS: dict[str, Rule] = {
    "lr": _set("optim.lr", float),
    "momentum": _set("optim.momentum", float),
    "weight_decay": _set("optim.weight_decay", float, "biases and norms are not decayed here"),
    "betas": _betas,
    "eps": _set("optim.eps", float),
}


def _reshard(value: Any, changes: dict[str, Any]) -> Out:
    changes["parallel.zero_stage"] = 3 if value else 2
    return (
        "applied",
        "parallel.zero_stage",
        "FSDP2, resharding after forward"
        if value
        else "FSDP2 keeping parameters gathered until backward",
    )


def _mixed(value: Any, changes: dict[str, Any]) -> Out:
    if value:
        changes.setdefault("parallel.param_dtype", "fp16")
        changes.setdefault("parallel.reduce_dtype", "fp16")
        return (
            "applied",
            "parallel.param_dtype/reduce_dtype",
            "fp16 compute and reduce-scatter, fp32 shards",
        )
    return ("applied", "", "fp32")


def _dtype(target: str) -> Rule:
    def rule(value: Any, changes: dict[str, Any]) -> Out:
        dtype = _DTYPES.get(str(value).rsplit(".", 1)[-1].lower()) if value is not None else None
        if value is None:
            return ("applied", "", "default")
        if dtype is None:
            return ("unsupported", "", f"dtype {value!r}")
        changes[target] = dtype
        return ("applied", target, "")

    return rule


def _fp32_reduce(value: Any, changes: dict[str, Any]) -> Out:
    if value:
        changes["parallel.reduce_dtype"] = "fp32"
        return ("applied", "parallel.reduce_dtype", "")
    return ("applied", "", "reduce in the compute dtype")


def _offload(value: Any, changes: dict[str, Any]) -> Out:
    if value:
        changes["parallel.offload"] = "cpu"
        return (
            "mapped",
            "parallel.offload",
            "FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer step on the host",
        )
    return ("applied", "", "no offload")


RULES: dict[str, dict[str, Rule]] = {
    "OSS": {
        "optim": _optim,
        **_OPTIMIZER_KEYS,
        "broadcast_buffer_size": _mapped(
            "ZeroRedundancyOptimizer broadcasts each updated parameter from its owner"
        ),
        "broadcast_fp16": _only(False, "fp16 parameter broadcast is not built"),
        "force_broadcast_object": _mapped("no effect: objects are broadcast by torch.distributed"),
        "group": _only(None, "a custom process group: the engine shards over its dp group"),
    },
    "ShardedDataParallel": {
        "broadcast_buffers": _only(True, "buffers are always broadcast from rank 0 at start"),
        "sync_models_at_startup": _set("parallel.init_sync", bool),
        "reduce_buffer_size": _mapped("FSDP2 reduce-scatters per wrapped unit (--wrap)"),
        "auto_refresh_trainable": _mapped("FSDP2 tracks parameters that require gradients"),
        "reduce_fp16": _when("parallel.reduce_dtype", "fp16", "fp32 reduce"),
        "warn_on_trainable_params_changed": _mapped("no effect"),
        "process_group": _only(None, "a custom process group: the engine shards over its dp group"),
    },
    "FullyShardedDataParallel": {
        "reshard_after_forward": _reshard,
        "disable_reshard_on_root": _only(
            True, "the root is never resharded after forward here", "FSDP2 keeps the root gathered"
        ),
        "mixed_precision": _mixed,
        "fp32_reduce_scatter": _fp32_reduce,
        "compute_dtype": _dtype("parallel.param_dtype"),
        "buffer_dtype": _only(None, "buffers keep their dtype here"),
        "flatten_parameters": _mapped(
            "FSDP2 shards each parameter (DTensor) instead of one flat buffer: same communication per unit"
        ),
        "move_params_to_cpu": _offload,
        "cpu_offload": _offload,
        "move_grads_to_cpu": _mapped("with offload the gradients live on the host too"),
        "bucket_cap_mb": _mapped(
            "FSDP2 reduce-scatters per wrapped unit (--wrap, --wrap-min-params)"
        ),
        "compute_device": _mapped("the device is the rank's (CUDA when present)"),
        "no_broadcast_optim_state": _mapped("optimizer state is checkpointed sharded (DCP)"),
        "state_dict_device": _mapped("checkpoints are DCP, written shard by shard"),
        "state_dict_on_rank_0_only": _mapped("checkpoints are DCP, written shard by shard"),
        "clear_autocast_cache": _mapped("no effect"),
        "force_input_to_fp32": _only(False, "casting inputs to fp32 is not built"),
        "verbose": _mapped("no effect"),
        "offload_config": _only(None, "SSD offload is not built"),
        "gradient_predivide_factor": _only(None, "gradients are averaged after the reduce here"),
        "limit_all_gather_events": _mapped(
            "a performance knob: FSDP2 limits in-flight all-gathers itself"
        ),
        "process_group": _only(None, "a custom process group: the engine shards over its dp group"),
        "process_group_reduce_scatter": _only(None, "a custom process group is not built"),
    },
}
_STAGE = {"OSS": 1, "ShardedDataParallel": 2, "FullyShardedDataParallel": 3}


def _backend(value: Any, changes: dict[str, Any]) -> Out:
    if value in ("c10d", "pytorch_ddp", "legacy_ddp", "no_c10d"):
        changes.setdefault("parallel.zero_stage", 0)
        return ("mapped", "parallel.zero_stage", "DDP")
    if value == "fully_sharded":
        changes.setdefault("parallel.zero_stage", 3)
        return ("applied", "parallel.zero_stage", "FairScale FSDP -> FSDP2")
    return ("unsupported", "", f"ddp_backend {value!r} (SlowMo and others) is not built")


FAIRSEQ: dict[str, Rule] = {
    "distributed_training.ddp_backend": _backend,
    "distributed_training.zero_sharding": _zero_sharding,
    "distributed_training.no_reshard_after_forward": _no_reshard,
    "distributed_training.cpu_offload": _offload,
    "distributed_training.fp32_reduce_scatter": _fp32_reduce,
    "distributed_training.distributed_world_size": _mapped(
        "the world size is the launcher's (--nproc-per-node x --nnodes)"
    ),
    "common.fp16": _when("parallel.param_dtype", "fp16", "fp16 off"),
    "common.bf16": _when("parallel.param_dtype", "bf16", "bf16 off"),
    "common.memory_efficient_fp16": _only(False, "fp16 without fp32 master weights is not built"),
    "optimization.clip_norm": _set("optim.grad_clip", float),
    "optimization.lr": _set(
        "optim.lr",
        lambda v: float(v[0] if isinstance(v, list) else v),
        "the first of fairseq's per-epoch list",
    ),
    "optimization.update_freq": _set(
        "grad_accum",
        lambda v: int(v[0] if isinstance(v, list) else v),
        "gradient accumulation steps (the first of fairseq's per-epoch list)",
    ),
    "optimization.max_update": _set("max_steps", int),
}


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f"unknown key; did you mean {close[0]!r}?" if close else "unknown key"


def import_fairscale(
    spec: Mapping[str, Any] | str | Path, base: C, *, strict: bool = False
) -> tuple[C, ConfigReport]:
    """The engine config a FairScale set-up describes, on top of ``base``, and the report.

    Raises:
        ValueError: nothing FairScale in ``spec``, a wrong-typed value, or with ``strict`` an
            unsupported key (all listed).
    """
    data = read_json(spec, "FairScale config") if isinstance(spec, (str, Path)) else dict(spec)
    report = ConfigReport("FairScale config")
    changes: dict[str, Any] = {}
    wrappers = [name for name in _STAGE if name in data]
    fairseq = any(section in data for section in ("distributed_training", "common", "optimization"))
    if not wrappers and not fairseq:
        raise ValueError(
            "a FairScale config names OSS, ShardedDataParallel or FullyShardedDataParallel (with "
            "their arguments), or holds fairseq's distributed_training section; got keys "
            f"{sorted(data)}"
        )
    if wrappers:  # the strongest sharding wins: FSDP > SDP (+OSS) > OSS
        changes["parallel.zero_stage"] = max(_STAGE[w] for w in wrappers)
    for top, value in data.items():
        if top in RULES and isinstance(value, dict):
            for key, arg in value.items():
                rule = RULES[top].get(key)
                try:
                    status, target, note = (
                        rule(arg, changes)
                        if rule
                        else ("unsupported", "", _suggest(key, list(RULES[top])))
                    )
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"FairScale {top}({key}={arg!r}): {exc}") from None
                report.entries.append(KeyReport(f"{top}.{key}", arg, status, target, note))  # type: ignore[arg-type]
        elif isinstance(value, dict) and top in ("distributed_training", "common", "optimization"):
            first = ("ddp_backend", "zero_sharding")  # the stage, before what refines it
            for key, arg in sorted(value.items(), key=lambda kv: kv[0] not in first):
                path = f"{top}.{key}"
                rule = FAIRSEQ.get(path)
                status, target, note = (
                    rule(arg, changes)
                    if rule
                    else (
                        "unsupported",
                        "",
                        "a fairseq setting with no FairScale meaning: not imported",
                    )
                )
                report.entries.append(KeyReport(path, arg, status, target, note))  # type: ignore[arg-type]
        else:
            hint = _suggest(top, [*RULES, "distributed_training", "common", "optimization"])
            report.entries.append(KeyReport(top, value, "unsupported", "", hint))
    report.check_strict(strict)
    return apply_changes(base, changes), report
