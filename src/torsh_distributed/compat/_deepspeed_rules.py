"""The rule for each DeepSpeed config key (see :mod:`.deepspeed`): what it becomes here.

A rule takes the key's value and the :class:`Context` and returns an :class:`Outcome`; rules
that change a setting record it in ``ctx.changes`` (dotted names of our config). Keys of
DeepSpeed's documented schema (https://www.deepspeed.ai/docs/config-json/) are listed here,
including deprecated ones still found in public configs (``zero_optimization.cpu_offload``).
The keys that describe how the model computes (activation checkpointing, compile, tensor
parallelism, low-precision master state) are in :mod:`._deepspeed_model_rules`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Context", "Outcome", "RULES", "SECTIONS"]


@dataclass(frozen=True, slots=True)
class Outcome:
    status: str
    target: str = ""
    note: str = ""


@dataclass(slots=True)
class Context:
    """What the rules read (the whole config, our settings) and write (changes, the batch)."""

    data: dict[str, Any]
    settings: dict[str, Any]
    dp_world: int
    """Data-parallel ranks: ``world_size / (tp * pp)`` (a tensor-parallel rule may change it)."""
    hidden_size: int | None
    world_size: int = 0
    """Ranks of the run."""
    changes: dict[str, Any] = field(default_factory=dict)
    derived: list[tuple[str, Any, str, str]] = field(default_factory=list)
    batch: dict[str, int] = field(default_factory=dict)

    def get(self, dotted: str) -> Any:
        """Our setting, as changed so far."""
        if dotted in self.changes:
            return self.changes[dotted]
        section, _, name = dotted.rpartition(".")
        return (self.settings[section] if section else self.settings)[name]

    def set(self, dotted: str, value: Any) -> None:
        self.changes[dotted] = value

    def section(self, name: str) -> dict[str, Any]:
        value = self.data.get(name)
        return value if isinstance(value, dict) else {}

    def zero_stage(self) -> int:
        stage = self.section("zero_optimization").get("stage", 0)
        return stage if isinstance(stage, int) else int(self.get("parallel.zero_stage"))


Rule = Callable[[Any, Context], Outcome]


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f'DeepSpeed {key} must be an integer or "auto", got {value!r}')
    return value


def _num(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f'DeepSpeed {key} must be a number or "auto", got {value!r}')
    return float(value)


def _batch(name: str, key: str) -> Rule:
    def rule(value: Any, ctx: Context) -> Outcome:
        if value == "auto":  # resolved with the other two (Context.finish_batch)
            ctx.batch[name] = -1
            return Outcome("applied", "batch_size / grad_accum", "auto: Hugging Face's rule")
        ctx.batch[name] = _int(key, value)
        if ctx.batch[name] < 1:
            raise ValueError(f"DeepSpeed {key} must be >= 1, got {value}")
        return Outcome("applied", "batch_size / grad_accum")

    return rule


def _set(
    target: str, key: str, *, convert: Callable[[Any], Any] = lambda v: v, auto: str = ""
) -> Rule:
    """Applied as ``target = convert(value)``; ``"auto"`` keeps our value (``auto`` names it)."""

    def rule(value: Any, ctx: Context) -> Outcome:
        if value == "auto":
            return Outcome("applied", target, f"auto -> {ctx.get(auto or target)}")
        ctx.set(target, convert(value))
        return Outcome("applied", target)

    return rule


def _fixed(expected: Any, why: str, *, status_if_equal: str = "applied") -> Rule:
    """Supported only at ``expected`` (our behaviour); anything else is unsupported."""

    def rule(value: Any, ctx: Context) -> Outcome:
        if value == expected or value == "auto":
            return Outcome(
                status_if_equal, "", "our behaviour" if status_if_equal == "applied" else why
            )
        return Outcome("unsupported", "", why)

    return rule


def _unsupported(why: str) -> Rule:
    return lambda value, ctx: Outcome("unsupported", "", why)


def _mapped(note: str, target: str = "") -> Rule:
    return lambda value, ctx: Outcome("mapped", target, note)


def _perf(name: str) -> Rule:
    return _mapped(f"{name}: a performance knob; torch schedules and overlaps communication itself")


def _off_or(why: str) -> Rule:
    """Booleans whose ``false`` is our behaviour and ``true`` a feature we lack."""

    def rule(value: Any, ctx: Context) -> Outcome:
        if value in (False, None, "auto"):
            return Outcome("applied", "", "off, as here")
        return Outcome("unsupported", "", why)

    return rule


def _monitor_section(name: str) -> Rule:
    def rule(value: Any, ctx: Context) -> Outcome:
        if not ctx.section(name).get("enabled", False):
            return Outcome("mapped", "", f"{name} disabled: nothing to do")
        return Outcome("unsupported", "", f"{name}: use --monitor (JSONL, Prometheus, dashboard)")

    return rule


# -- optimizer and scheduler ------------------------------------------------------------------
_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}


def _optimizer_type(value: Any, ctx: Context) -> Outcome:
    kind = _OPTIMIZERS.get(str(value).lower())
    if kind is None:
        return Outcome(
            "unsupported",
            "optim.optimizer",
            f"{value}: only Adam, AdamW and SGD; keeping {ctx.get('optim.optimizer')}",
        )
    ctx.set("optim.optimizer", kind)
    adam_w = ctx.section("optimizer").get("params", {}).get("adam_w_mode", True)
    if str(value).lower() == "adam" and adam_w:
        return Outcome(
            "mapped", "optim.optimizer", "DeepSpeed's Adam with adam_w_mode=true is AdamW"
        )
    return Outcome("applied", "optim.optimizer")


def _betas(value: Any, ctx: Context) -> Outcome:
    if value == "auto":
        return Outcome(
            "applied",
            "optim.beta1/beta2",
            f"auto -> [{ctx.get('optim.beta1')}, {ctx.get('optim.beta2')}]",
        )
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"DeepSpeed optimizer.params.betas must be [beta1, beta2], got {value!r}")
    ctx.set("optim.beta1", _num("optimizer.params.betas", value[0]))
    ctx.set("optim.beta2", _num("optimizer.params.betas", value[1]))
    return Outcome("applied", "optim.beta1/beta2")


def _weight_decay(value: Any, ctx: Context) -> Outcome:
    out = _set("optim.weight_decay", "weight_decay", convert=lambda v: _num("weight_decay", v))(
        value, ctx
    )
    return Outcome(
        "mapped",
        out.target,
        (out.note + "; " if out.note else "")
        + "biases and norms are not decayed (as Hugging Face's Trainer groups them)",
    )


_SCHEDULES = {"warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}


def _scheduler_type(value: Any, ctx: Context) -> Outcome:
    schedule = _SCHEDULES.get(str(value).lower())
    if schedule is None:
        return Outcome(
            "unsupported",
            "optim.schedule",
            f"{value}: only WarmupLR, WarmupDecayLR, WarmupCosineLR",
        )
    ctx.set("optim.schedule", schedule)
    if schedule == "linear":
        ctx.set("optim.min_lr_ratio", 0.0)  # WarmupDecayLR decays to 0
    return Outcome("applied", "optim.schedule", f"{schedule} after warm-up")


def _warmup_type(value: Any, ctx: Context) -> Outcome:
    if value == "linear":
        return Outcome("applied", "", "linear warm-up")
    return Outcome("mapped", "", f"{value} warm-up done linearly here")


def _warmup_min(value: Any, ctx: Context) -> Outcome:
    if value in (0, 0.0, "auto"):
        return Outcome("applied", "", "warm-up from 0")
    return Outcome("unsupported", "", "warm-up always starts from 0 here")


def _total_steps(value: Any, ctx: Context) -> Outcome:
    return _set("max_steps", "total_num_steps", convert=lambda v: _int("total_num_steps", v))(
        value, ctx
    )


# -- precision --------------------------------------------------------------------------------
def _fp16_enabled(value: Any, ctx: Context) -> Outcome:
    if value == "auto":
        return Outcome(
            "applied", "parallel.param_dtype", f"auto -> {ctx.get('parallel.param_dtype')}"
        )
    if value:
        ctx.set("parallel.param_dtype", "fp16")
        return Outcome(
            "applied",
            "parallel.param_dtype",
            "fp16 compute, fp32 master weights, dynamic loss scaling",
        )
    return Outcome("applied", "", "fp16 off")


def _bf16_enabled(value: Any, ctx: Context) -> Outcome:
    if value == "auto":
        return Outcome(
            "applied", "parallel.param_dtype", f"auto -> {ctx.get('parallel.param_dtype')}"
        )
    if value:
        ctx.set("parallel.param_dtype", "bf16")
        return Outcome("applied", "parallel.param_dtype")
    return Outcome("applied", "", "bf16 off")


def _fp16_on(ctx: Context) -> bool:
    enabled = ctx.section("fp16").get("enabled", False)
    return enabled is True or (enabled == "auto" and ctx.get("parallel.param_dtype") == "fp16")


def _when_fp16(inner: Rule) -> Rule:
    """Loss-scaling keys matter only when fp16 ends up on."""

    def rule(value: Any, ctx: Context) -> Outcome:
        if not _fp16_on(ctx):
            return Outcome("mapped", "", "fp16 is off: no loss scaling")
        return inner(value, ctx)

    return rule


def _loss_scale(value: Any, ctx: Context) -> Outcome:
    if value in (0, 0.0, "auto"):
        return Outcome("applied", "", "dynamic loss scaling")
    return Outcome("unsupported", "", "a static loss scale: the scaler here is dynamic")


def _hysteresis(value: Any, ctx: Context) -> Outcome:
    if value in (1, "auto"):
        return Outcome("applied", "", "the scale halves on every overflow")
    return Outcome(
        "unsupported",
        "",
        f"hysteresis {value}: the scale halves on every overflow here (hysteresis 1)",
    )


def _communication_dtype(value: Any, ctx: Context) -> Outcome:
    dtype = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", None: None}.get(value, "?")
    if dtype == "?":
        return Outcome("unsupported", "", f"unknown dtype {value!r}")
    if dtype is None:
        return Outcome("applied", "", "default")
    if ctx.zero_stage() >= 2:
        ctx.set("parallel.reduce_dtype", dtype)
        return Outcome("mapped", "parallel.reduce_dtype", "FSDP2's reduce-scatter dtype")
    return Outcome("unsupported", "", "stages 0-1 all-reduce fp32 here (use --compression fp16)")


# -- ZeRO -------------------------------------------------------------------------------------
def _stage(value: Any, ctx: Context) -> Outcome:
    stage = _int("zero_optimization.stage", value)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed zero_optimization.stage must be 0-3, got {stage}")
    ctx.set("parallel.zero_stage", stage)
    return Outcome(
        "applied",
        "parallel.zero_stage",
        ("DDP", "ZeroRedundancyOptimizer", "FSDP2", "FSDP2")[stage],
    )


def _offload_device(value: Any, ctx: Context) -> Outcome:
    if value in ("none", None):
        return Outcome("applied", "", "no offload")
    if value == "cpu":
        if ctx.zero_stage() < 2:
            return Outcome(
                "unsupported",
                "",
                "CPU offload needs ZeRO stage 2-3 here (FSDP2's CPUOffloadPolicy)",
            )
        ctx.set("parallel.offload", "cpu")
        return Outcome(
            "mapped",
            "parallel.offload",
            "FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer step on the host",
        )
    return Outcome("unsupported", "", f"{value} offload (NVMe) is not built")


def _cpu_offload(value: Any, ctx: Context) -> Outcome:
    return _offload_device("cpu" if value else "none", ctx)


def _bucket(name: str) -> Rule:
    def rule(value: Any, ctx: Context) -> Outcome:
        if value == "auto":
            if ctx.hidden_size is None:
                return Outcome("mapped", "", "auto: no hidden size known; torch's default buckets")
            value = ctx.hidden_size * ctx.hidden_size
        size = _num(f"zero_optimization.{name}", value)
        if ctx.zero_stage() >= 2:
            return Outcome(
                "unsupported",
                "",
                "FSDP2 communicates per wrapped unit: use --wrap size --wrap-min-params",
            )
        mb = size * 4 / 2**20  # elements of fp32 gradients
        ctx.set("parallel.bucket_cap_mb", round(mb, 3))
        return Outcome(
            "mapped",
            "parallel.bucket_cap_mb",
            f"{size:.0f} elements = {mb:.1f} MB of fp32 gradients",
        )

    return rule


_ZERO_UNSUPPORTED = {
    "stage3_max_live_parameters": "FSDP2 gathers per wrapped unit",
    "stage3_max_reuse_distance": "FSDP2 gathers per wrapped unit",
    "stage3_prefetch_bucket_size": "FSDP2 prefetches the next unit",
    "stage3_param_persistence_threshold": "FSDP2 shards every parameter of a unit",
    "sub_group_size": "the optimizer steps over the whole local shard",
    "round_robin_gradients": "not built",
    "zero_hpz_partition_size": "hierarchical partitioning (ZeRO++) is not built",
    "zero_quantized_nontrainable_weights": "ZeRO++ quantisation is not built",
    "mics_shard_size": "MiCS is not built",
    "mics_hierarchical_params_gather": "MiCS is not built",
    "legacy_stage1": "not built",
    "cpu_offload_params": "use offload_param.device (stage 3) - deprecated key",
    "cpu_offload_use_pin_memory": "deprecated key",
    "memory_efficient_linear": "not built",
    "ignore_unused_parameters": "DDP's find_unused_parameters is --find-unused-parameters",
}


def _zero_quantized(value: Any, ctx: Context) -> Outcome:
    """ZeRO++'s qwZ / qgZ: --compression int8 at stages 2-3 quantises both FSDP2 collectives."""
    if value in (False, None, "auto"):
        return Outcome("applied", "", "off, as here")
    if ctx.zero_stage() < 2:
        return Outcome(
            "unsupported", "", "ZeRO++ quantisation needs stage 2-3 (FSDP2's collectives) here"
        )
    ctx.set("compression.method", "int8")
    return Outcome(
        "mapped",
        "compression.method",
        "int8 with per-block (256) scales for both the parameter all-gather and the gradient "
        "reduce-scatter (one flag for both; quantize_collectives(weights=, gradients=) picks one)",
    )


def _stage3_gather(value: Any, ctx: Context) -> Outcome:
    return Outcome(
        "mapped", "", "checkpoints are DCP; torsh_distributed.inference.load reads them whole"
    )


def _steps_per_print(value: Any, ctx: Context) -> Outcome:
    if value != "auto":
        ctx.set("log_every", _int("steps_per_print", value))
    return Outcome("mapped", "log_every", "progress and log lines every N steps")


def _wall_clock(value: Any, ctx: Context) -> Outcome:
    if value is True:
        ctx.set("monitor.enabled", True)
        return Outcome("mapped", "monitor.enabled", "the step monitor's phase timings")
    return Outcome("applied", "", "off, as here")


RULES: dict[str, Rule] = {
    "train_batch_size": _batch("train", "train_batch_size"),
    "train_micro_batch_size_per_gpu": _batch("micro", "train_micro_batch_size_per_gpu"),
    "gradient_accumulation_steps": _batch("accum", "gradient_accumulation_steps"),
    "gradient_clipping": _set(
        "optim.grad_clip", "gradient_clipping", convert=lambda v: _num("gradient_clipping", v)
    ),
    "steps_per_print": _steps_per_print,
    "wall_clock_breakdown": _wall_clock,
    "memory_breakdown": _mapped("the engine reports predicted vs measured memory after step 1"),
    "dump_state": _off_or("dumping the engine state is not built"),
    "prescale_gradients": _off_or("gradients are averaged after the reduce here"),
    "gradient_predivide_factor": _fixed(1.0, "gradients are averaged after the reduce here"),
    "sparse_gradients": _off_or("sparse gradient all-reduce is not built"),
    "communication_data_type": _communication_dtype,
    "gradient_accumulation_dtype": _fixed(
        "fp32", "gradients accumulate in the parameters' dtype (fp32)"
    ),
    "zero_allow_untested_optimizer": _mapped("any torch optimizer works with our ZeRO stages"),
    "zero_force_ds_cpu_optimizer": _mapped(
        "the optimizer is torch's (on the host with CPU offload)"
    ),
    "fp16.enabled": _fp16_enabled,
    "fp16.auto_cast": _mapped(
        "autocast (stages 0-1) or FSDP2's MixedPrecisionPolicy casts the computation"
    ),
    "fp16.loss_scale": _when_fp16(_loss_scale),
    "fp16.initial_scale_power": _when_fp16(
        _set(
            "parallel.loss_scale_init",
            "initial_scale_power",
            convert=lambda v: float(2 ** _int("fp16.initial_scale_power", v)),
        )
    ),
    "fp16.loss_scale_window": _when_fp16(
        _set(
            "parallel.loss_scale_growth_interval",
            "loss_scale_window",
            convert=lambda v: _int("fp16.loss_scale_window", v),
        )
    ),
    "fp16.hysteresis": _when_fp16(_hysteresis),
    "fp16.consecutive_hysteresis": _when_fp16(
        _off_or("consecutive hysteresis is not built (hysteresis 1)")
    ),
    "fp16.min_loss_scale": _when_fp16(
        _mapped("the scale is not floored here; steps with inf/nan gradients are skipped")
    ),
    "fp16.fp16_master_weights_and_grads": _off_or("master weights stay fp32 here"),
    "bf16.enabled": _bf16_enabled,
    "bf16.immediate_grad_update": _unsupported("not built"),
    "bf16.check_grad_overflow": _unsupported("not built"),
    "amp.*": _monitor_section("amp"),
    "optimizer.type": _optimizer_type,
    "optimizer.params.lr": _set("optim.lr", "lr", convert=lambda v: _num("optimizer.params.lr", v)),
    "optimizer.params.betas": _betas,
    "optimizer.params.eps": _set(
        "optim.eps", "eps", convert=lambda v: _num("optimizer.params.eps", v)
    ),
    "optimizer.params.weight_decay": _weight_decay,
    "optimizer.params.momentum": _set(
        "optim.momentum", "momentum", convert=lambda v: _num("optimizer.params.momentum", v)
    ),
    "optimizer.params.adam_w_mode": _fixed(
        True, "Adam with L2 regularisation (adam_w_mode=false) is not built"
    ),
    "optimizer.params.torch_adam": _mapped("the optimizer is torch's AdamW"),
    "optimizer.params.bias_correction": _fixed(True, "AdamW without bias correction is not built"),
    "optimizer.params.amsgrad": _off_or("AMSGrad is not built"),
    "optimizer.params.nesterov": _off_or("Nesterov momentum is not built"),
    "optimizer.params.dampening": _fixed(0, "SGD dampening is not built"),
    "optimizer.params.*": _unsupported("an optimizer parameter with no equivalent here"),
    "scheduler.type": _scheduler_type,
    "scheduler.params.warmup_min_lr": _warmup_min,
    "scheduler.params.warmup_min_ratio": _warmup_min,
    "scheduler.params.warmup_max_lr": _set(
        "optim.lr", "warmup_max_lr", convert=lambda v: _num("scheduler.params.warmup_max_lr", v)
    ),
    "scheduler.params.warmup_num_steps": _set(
        "optim.warmup_steps",
        "warmup_num_steps",
        convert=lambda v: _int("scheduler.params.warmup_num_steps", v),
    ),
    "scheduler.params.total_num_steps": _total_steps,
    "scheduler.params.warmup_type": _warmup_type,
    "scheduler.params.cos_min_ratio": _set(
        "optim.min_lr_ratio",
        "cos_min_ratio",
        convert=lambda v: _num("scheduler.params.cos_min_ratio", v),
    ),
    "scheduler.params.last_batch_iteration": _fixed(
        -1, "resume the schedule with --resume (the step is checkpointed)"
    ),
    "scheduler.params.*": _unsupported("a scheduler parameter with no equivalent here"),
    "zero_optimization.stage": _stage,
    "zero_optimization.offload_optimizer.device": _offload_device,
    "zero_optimization.offload_param.device": _offload_device,
    "zero_optimization.offload_optimizer.pin_memory": _mapped(
        "host memory is pinned when CUDA is present"
    ),
    "zero_optimization.offload_param.pin_memory": _mapped(
        "host memory is pinned when CUDA is present"
    ),
    "zero_optimization.offload_optimizer.ratio": _fixed(
        1.0, "partial optimizer offload is not built"
    ),
    "zero_optimization.offload_optimizer.*": _unsupported(
        "an NVMe/buffer setting of DeepSpeed's offload engine"
    ),
    "zero_optimization.offload_param.*": _unsupported(
        "an NVMe/buffer setting of DeepSpeed's offload engine"
    ),
    "zero_optimization.cpu_offload": _cpu_offload,
    "zero_optimization.reduce_bucket_size": _bucket("reduce_bucket_size"),
    "zero_optimization.allgather_bucket_size": _bucket("allgather_bucket_size"),
    "zero_optimization.overlap_comm": _perf("overlap_comm"),
    "zero_optimization.contiguous_gradients": _perf("contiguous_gradients"),
    "zero_optimization.reduce_scatter": _perf("reduce_scatter"),
    "zero_optimization.allgather_partitions": _perf("allgather_partitions"),
    "zero_optimization.elastic_checkpoint": _mapped("DCP checkpoints reshard to any world size"),
    "zero_optimization.load_from_fp32_weights": _mapped("checkpoints hold the fp32 weights"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _stage3_gather,
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": _stage3_gather,
    "zero_optimization.zero_quantized_weights": _zero_quantized,
    "zero_optimization.zero_quantized_gradients": _zero_quantized,
    **{f"zero_optimization.{k}": _unsupported(why) for k, why in _ZERO_UNSUPPORTED.items()},
    "tensorboard.*": _monitor_section("tensorboard"),
    "wandb.*": _monitor_section("wandb"),
    "csv_monitor.*": _monitor_section("csv_monitor"),
    "comet.*": _monitor_section("comet"),
    "flops_profiler.*": _monitor_section("flops_profiler"),
    "comms_logger.*": _monitor_section("comms_logger"),
    "aio.*": _unsupported("NVMe asynchronous I/O is not built"),
    "elasticity.*": _unsupported(
        "DeepSpeed's elastic batch sizes: use torsh-dist run --nnodes MIN:MAX"
    ),
    "autotuning.*": _unsupported("autotuning is not built (see torsh-dist plan)"),
    "data_efficiency.*": _unsupported("data efficiency (curriculum, token dropping) is not built"),
    "curriculum_learning.*": _unsupported("curriculum learning is not built"),
    "compression_training.*": _unsupported("DeepSpeed compression training is not built"),
    "pipeline.*": _unsupported("DeepSpeed's pipeline engine: use --pp with --pp-split"),
    "checkpoint.*": _mapped("checkpoints are DCP with SHA-256 manifests (--checkpoint-dir)"),
    "nebula.*": _unsupported("Nebula checkpointing is not built"),
    "sparse_attention.*": _unsupported("DeepSpeed's sparse attention kernels are not built"),
    "hybrid_engine.*": _monitor_section("hybrid_engine"),
    "sequence_parallel_size": _unsupported(
        "Ulysses sequence parallelism is not built (see --sequence-parallel with --tp)"
    ),
}

# Known sections: descended into (their keys are classified one by one).
SECTIONS = frozenset(
    {
        "fp16",
        "bf16",
        "amp",
        "optimizer",
        "optimizer.params",
        "scheduler",
        "scheduler.params",
        "zero_optimization",
        "zero_optimization.offload_optimizer",
        "zero_optimization.offload_param",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "flops_profiler",
        "comms_logger",
        "aio",
        "elasticity",
        "autotuning",
        "data_efficiency",
        "curriculum_learning",
        "compression_training",
        "pipeline",
        "checkpoint",
        "nebula",
    }
)
