"""The trainer's ``parallel`` section: ZeRO stage, offload, mixed precision, checkpointing.

Torch-free so that building and validating configs (the CLI) stays fast.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

__all__ = ["ParallelConfig", "check_world", "parse_activation_checkpointing", "ZERO_STAGES"]

ZERO_STAGES = (0, 1, 2, 3)
_DTYPES = ("fp32", "bf16", "fp16")
_PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
_DDP_FIELDS = (
    "bucket_cap_mb",
    "first_bucket_mb",
    "static_graph",
    "gradient_as_bucket_view",
    "find_unused_parameters",
    "init_sync",
)


def parse_activation_checkpointing(text: str) -> int:
    """``none`` -> 0, ``full`` -> 1 (every block), ``every-k`` -> k (every k-th block).

    Raises:
        ValueError: anything else.
    """
    if text == "none":
        return 0
    if text == "full":
        return 1
    if text.startswith("every-"):
        try:
            k = int(text.removeprefix("every-"))
        except ValueError:
            k = 0
        if k >= 1:
            return k
    raise ValueError(
        f"parallel.activation_checkpointing must be none, full or every-K (K >= 1, e.g. every-2); "
        f"got {text!r}"
    )


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Data-parallel sharding: one setting switches DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2)."""

    zero_stage: int = field(default=0, metadata={"flags": ["--zero-stage"]})
    """0 = DDP; 1 = DDP + torch's ZeroRedundancyOptimizer (optimizer state sharded); 2 = FSDP2
    without resharding after forward (gradients and optimizer state sharded; parameters gathered
    once per step); 3 = FSDP2 (parameters too; re-gathered in backward, least memory)."""
    offload: str = "none"
    """``none`` or ``cpu``: torch's CPUOffloadPolicy keeps sharded parameters, gradients and
    optimizer state in host memory and steps the optimizer there (stages 2-3 only). Saves device
    memory at the cost of host-device copies every step; on a CPU-only run it moves nothing."""
    param_dtype: str = "fp32"
    """Compute dtype of forward/backward: ``fp32``, ``bf16`` or ``fp16``. Stages 2-3: FSDP2's
    MixedPrecisionPolicy (gathered parameters in this dtype; the fp32 shards stay the master
    copy). Stages 0-1: ``torch.autocast`` around the forward (matmuls in 16 bits, norms and the
    loss in fp32). fp16 turns on loss scaling (fp16's narrow range under/overflows gradients)."""
    reduce_dtype: str = "fp32"
    """Dtype of the gradient reduce-scatter (stages 2-3): ``fp32`` (exact sums), ``bf16`` or
    ``fp16`` (half the traffic, rounding in the sum; fp16 turns on loss scaling). Stages 0-1
    reduce fp32 gradients (use ``--compression fp16`` for 16-bit all-reduce there)."""
    loss_scale_init: float = 2.0**15
    """fp16 only: initial loss scale of the dynamic scaler (halved on every overflow, which skips
    that step on all ranks). torch's default 2**16 is inf in fp16, so with an fp16 loss (FSDP2)
    the first step would always be skipped; 2**15 is the largest power of two fp16 holds."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: double the loss scale after this many steps without overflow (torch's default)."""
    activation_checkpointing: str = field(
        default="none", metadata={"flags": ["--activation-checkpointing", "--ac"]}
    )
    """``none``, ``full`` (recompute every block in backward) or ``every-K`` (every K-th block):
    trades about one extra forward for the blocks' saved activations."""
    wrap: str = "block"
    """FSDP unit policy: ``block`` (each transformer block is a unit, by module type) or ``size``
    (any submodule with at least ``wrap_min_params`` parameters). Smaller units lower stage 3's
    transient memory but issue more, smaller collectives."""
    wrap_min_params: int = 100_000
    """Parameter threshold of ``wrap=size``."""
    meta_init: bool = field(default=False, metadata={"negatable": True})
    """Build the model on the ``meta`` device, shard it, then allocate and initialise only the
    local shards: no rank ever holds the full model. The initial draw then differs from the
    default (same distribution), so losses are not comparable with a run without it."""

    # --- model parallelism: see parallel/tp_plan.py, parallel/pipeline.py ---
    tp: int = field(default=1, metadata={"flags": ["--tp"]})
    """Tensor-parallel degree: attention heads, MLP width and vocabulary sharded over ``tp``
    ranks (innermost mesh axis). Saves memory per rank at the cost of two all-reduces per block."""
    pp: int = field(default=1, metadata={"flags": ["--pp"]})
    """Pipeline-parallel degree: the blocks split into ``pp`` stages (times ``virtual_stages``),
    evenly or at ``pp_split``. Idle time (the bubble) is ``(pp-1)/(microbatches+pp-1)`` of a step."""
    pp_split: str = field(default="", metadata={"flags": ["--pp-split"]})
    """Comma-separated module names where stages 1, 2, ... begin (``layers.4`` or
    ``layers.2,layers.5``): entries of the model's container of repeated blocks. Empty = an even
    split of that container. Uneven splits balance a last stage that also runs the head."""
    ep: int = field(default=1, metadata={"flags": ["--ep"]})
    """Expert-parallel degree: the experts of every MoE layer sharded over ``ep`` ranks, tokens
    sent to their experts by all-to-all. The ep ranks hold different tokens (ep borrows from data
    parallelism: the batch is split over ``dp * ep`` ranks); ``num_experts`` must divide by it."""
    ep_rebalance_every: int = field(default=0, metadata={"flags": ["--ep-rebalance-every"]})
    """With ``ep > 1``: every this many steps, move experts between ep ranks when the ranks'
    routed load stayed skewed (CV above ``ep_rebalance_threshold``); weights and optimizer state
    move exactly, so the loss is unchanged. 0 = never."""
    ep_rebalance_threshold: float = field(
        default=0.1, metadata={"flags": ["--ep-rebalance-threshold"]}
    )
    """Load CV over the ep ranks above which the rebalancer moves experts."""
    dp: int = field(default=-1, metadata={"flags": ["--dp"]})
    """Data-parallel degree; -1 = the rest (world size / (tp * pp * ep)). ``dp * tp * pp * ep``
    must equal the world size."""
    pp_schedule: str = field(default="1f1b", metadata={"flags": ["--pp-schedule"]})
    """``gpipe`` (all forwards then all backwards; stashes every micro-batch's activations),
    ``1f1b`` (at most ``pp`` micro-batches in flight; same bubble) or ``interleaved`` (1F1B over
    ``virtual_stages`` stages per rank: bubble divided by ``virtual_stages``, more messages)."""
    microbatches: int = field(default=0, metadata={"flags": ["--microbatches"]})
    """Micro-batches per step with ``pp > 1``; 0 = ``pp * virtual_stages``. More shrink the
    bubble but make each micro-batch smaller."""
    virtual_stages: int = field(default=1, metadata={"flags": ["--virtual-stages"]})
    """Pipeline stages per rank (``interleaved`` only)."""
    sequence_parallel: bool = field(
        default=False, metadata={"flags": ["--sequence-parallel"], "negatable": True}
    )
    """Megatron-SP on top of ``tp > 1``: the residual stream, norms and dropouts between the
    tensor-parallel regions hold ``block_size / tp`` positions per rank, so the activations they
    save (norm inputs, dropout masks) take ``tp`` times less memory; each sub-layer all-gathers
    its input and reduce-scatters its output over the sequence instead of one all-reduce (the
    same volume, twice the collectives). Needs ``tp`` to divide ``model.block_size``."""

    @property
    def num_microbatches(self) -> int:
        """``microbatches``, with 0 resolved to ``pp * virtual_stages``."""
        return self.microbatches or self.pp * self.virtual_stages

    @property
    def model_parallel(self) -> bool:
        """Whether tensor or pipeline parallelism is on (then no DDP wrapper)."""
        return self.tp > 1 or self.pp > 1

    # --- end model parallelism ---

    compile: bool = field(default=False, metadata={"negatable": True})
    """``torch.compile`` each block (after activation checkpointing, before FSDP/DDP): faster
    steps after a compilation pause at the start; needs a working C++ toolchain on CPU."""

    # --- DDP's wrapper options (zero_stage 0-1 without tp/pp) ---
    bucket_cap_mb: float = field(default=25.0, metadata={"flags": ["--bucket-cap-mb"]})
    """DDP gradient bucket size in MiB: larger = fewer, larger exchanges (better bandwidth, less
    overlap with backward). Compression works per bucket."""
    first_bucket_mb: float = field(default=0.0, metadata={"flags": ["--first-bucket-mb"]})
    """Size of the first bucket (the last layers' gradients, ready first); a small one starts
    communication earlier. 0 = the same as ``bucket_cap_mb``."""
    static_graph: bool = field(
        default=False, metadata={"negatable": True, "flags": ["--static-graph"]}
    )
    """Tell DDP the set of used parameters never changes: enables its static-graph optimisations."""
    gradient_as_bucket_view: bool = field(
        default=False, metadata={"negatable": True, "flags": ["--gradient-as-bucket-view"]}
    )
    """Gradients are views into DDP's buckets: saves one gradient copy of memory and a copy per step."""
    find_unused_parameters: bool = field(
        default=False, metadata={"negatable": True, "flags": ["--find-unused-parameters"]}
    )
    """Traverse the graph each step to find parameters without gradients (costs time; needed
    only when some parameters are skipped in forward)."""
    init_sync: bool = field(default=True, metadata={"negatable": True, "flags": ["--init-sync"]})
    """Broadcast rank 0's parameters when DDP wraps the model (ranks start identical anyway
    from the shared seed; keep on unless startup time matters)."""

    def __post_init__(self) -> None:
        self._check_model_parallel()
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(
                f"parallel.zero_stage must be one of 0, 1, 2, 3; got {self.zero_stage}"
            )
        if self.offload not in ("none", "cpu"):
            raise ValueError(f"parallel.offload must be none or cpu; got {self.offload!r}")
        if self.offload != "none" and self.zero_stage < 2:
            raise ValueError(
                f"parallel.offload={self.offload!r} needs zero_stage 2 or 3: offload is FSDP2's "
                f"CPUOffloadPolicy, and stages 0-1 keep full replicas under DDP"
            )
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"parallel.{name} must be one of {', '.join(_DTYPES)}; got {getattr(self, name)!r}"
                )
        if self.reduce_dtype != "fp32" and self.zero_stage < 2:
            raise ValueError(
                f"parallel.reduce_dtype={self.reduce_dtype!r} needs zero_stage 2 or 3 (FSDP2's "
                f"MixedPrecisionPolicy): stages 0-1 are DDP, which all-reduces the fp32 gradients; "
                f"use --compression {self.reduce_dtype} for a 16-bit all-reduce there"
            )
        if "fp16" in (self.param_dtype, self.reduce_dtype) and self.model_parallel:
            raise ValueError(
                "parallel.param_dtype/reduce_dtype fp16 needs loss scaling, which does not combine "
                "with tp/pp > 1 (sharded and per-stage gradients); use bf16 there"
            )
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"parallel.bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.first_bucket_mb < 0:
            raise ValueError(f"parallel.first_bucket_mb must be >= 0, got {self.first_bucket_mb}")
        self._warn_ddp_options()
        if self.pp == 1 and (self.microbatches or self.pp_schedule != "1f1b"):
            warnings.warn(
                "parallel.microbatches/pp_schedule are ignored with pp 1 (no pipeline)",
                stacklevel=3,
            )
        if self.ep_rebalance_every and self.ep == 1:
            warnings.warn(
                "parallel.ep_rebalance_every is ignored with ep=1: rebalancing moves experts "
                "between ep ranks",
                stacklevel=3,
            )
        if self.zero_stage < 2 and (self.wrap != "block" or self.wrap_min_params != 100_000):
            warnings.warn(
                "parallel.wrap/wrap_min_params are ignored with zero_stage < 2 (no FSDP units)",
                stacklevel=3,
            )
        self._check_loss_scale()
        parse_activation_checkpointing(self.activation_checkpointing)
        if self.wrap not in ("block", "size"):
            raise ValueError(f"parallel.wrap must be block or size; got {self.wrap!r}")
        if self.wrap_min_params < 1:
            raise ValueError(f"parallel.wrap_min_params must be >= 1, got {self.wrap_min_params}")

    def _warn_ddp_options(self) -> None:
        defaults = ParallelConfig.__dataclass_fields__
        changed = [n for n in _DDP_FIELDS if getattr(self, n) != defaults[n].default]
        if changed and (self.zero_stage >= 2 or self.model_parallel):
            why = "FSDP2 (zero_stage >= 2)" if self.zero_stage >= 2 else "tp/pp > 1"
            warnings.warn(
                f"parallel.{', parallel.'.join(changed)} are DDP's options and are ignored with "
                f"{why}: no DDP wrapper is used there",
                stacklevel=3,
            )

    def _check_loss_scale(self) -> None:
        if not (self.loss_scale_init > 0 and math.isfinite(self.loss_scale_init)):
            raise ValueError(
                f"parallel.loss_scale_init must be a finite number > 0, got {self.loss_scale_init}"
            )
        if self.loss_scale_growth_interval < 1:
            raise ValueError(
                f"parallel.loss_scale_growth_interval must be >= 1, "
                f"got {self.loss_scale_growth_interval}"
            )
        fp16 = "fp16" in (self.param_dtype, self.reduce_dtype)
        default = (self.loss_scale_init, self.loss_scale_growth_interval) == (2.0**15, 2000)
        if not fp16 and not default:
            warnings.warn(
                "parallel.loss_scale_init/loss_scale_growth_interval are ignored: loss scaling "
                "is only used with param_dtype or reduce_dtype fp16",
                stacklevel=3,
            )

    def _check_model_parallel(self) -> None:  # world-size checks: engine (before any collective)
        for name in ("tp", "pp", "ep", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.ep_rebalance_every < 0 or self.ep_rebalance_threshold < 0:
            raise ValueError(
                "parallel.ep_rebalance_every and parallel.ep_rebalance_threshold must be >= 0; "
                f"got {self.ep_rebalance_every} and {self.ep_rebalance_threshold}"
            )
        if self.dp != -1 and self.dp < 1:
            raise ValueError(f"parallel.dp must be >= 1 or -1 (the rest), got {self.dp}")
        if self.microbatches < 0:
            raise ValueError(f"parallel.microbatches must be >= 0 (0 = pp), got {self.microbatches}")
        if self.pp_schedule not in _PP_SCHEDULES:
            raise ValueError(
                f"parallel.pp_schedule must be one of {', '.join(_PP_SCHEDULES)}; got {self.pp_schedule!r}"
            )
        if self.sequence_parallel and self.tp < 2:
            raise ValueError(
                f"parallel.sequence_parallel needs parallel.tp > 1 (it shards the sequence over "
                f"the tp axis); got tp={self.tp}"
            )
        if self.model_parallel and self.zero_stage == 1:
            raise ValueError(
                "parallel.tp/pp > 1 combine with zero_stage 0 (dp gradient all-reduce) or 2-3 "
                "(FSDP2 over the dp axis), not with zero_stage 1 (ZeroRedundancyOptimizer "
                "broadcasts whole parameters, not tensor-parallel shards)"
            )
        if self.ep > 1 and (self.model_parallel or self.zero_stage == 1):
            raise ValueError(
                f"parallel.ep={self.ep} combines with DDP (zero_stage 0) or FSDP2 (zero_stage 2-3) "
                f"and tp = pp = 1 for now (ZeroRedundancyOptimizer would broadcast one rank's "
                f"experts over the others'); got zero_stage={self.zero_stage}, tp={self.tp}, "
                f"pp={self.pp}"
            )
        if self.ep > 1 and self.zero_stage >= 2 and self.meta_init:
            raise ValueError(
                f"parallel.meta_init with ep={self.ep} and zero_stage {self.zero_stage} is not "
                "built: the dp replicas of each expert would be initialised from different "
                "seeds; build the model on the device (no meta_init)"
            )
        if self.pp_split and self.pp < 2:
            raise ValueError(f"parallel.pp_split={self.pp_split!r} needs parallel.pp > 1")
        names = [n.strip() for n in self.pp_split.split(",")] if self.pp_split else []
        if any(not n for n in names):
            raise ValueError(
                f"parallel.pp_split must be comma-separated module names like layers.4,layers.8; "
                f"got {self.pp_split!r}"
            )
        if names and len(names) != self.pp * self.virtual_stages - 1:
            raise ValueError(
                f"parallel.pp_split names {len(names)} split points; pp={self.pp} x "
                f"virtual_stages={self.virtual_stages} stages need {self.pp * self.virtual_stages - 1}"
            )

    @property
    def split_points(self) -> list[str] | None:
        """``pp_split`` as a list of module names; ``None`` = an even split."""
        return [n.strip() for n in self.pp_split.split(",")] if self.pp_split else None

    @property
    def checkpoint_every(self) -> int:
        """0 = no activation checkpointing, k = every k-th block (1 = all)."""
        return parse_activation_checkpointing(self.activation_checkpointing)


def check_world(config: ParallelConfig, dp: int) -> None:
    """Reject settings that are meaningless with ``dp`` data-parallel ranks.

    Raises:
        ValueError: a ZeRO stage >= 1 with a single data-parallel rank (nothing to shard across).
    """
    if config.zero_stage >= 1 and dp < 2:
        raise ValueError(
            f"parallel.zero_stage {config.zero_stage} shards model states across data-parallel "
            f"ranks, but there is {dp} data-parallel rank; use zero_stage 0 or launch "
            f"dp >= 2 ranks"
        )
