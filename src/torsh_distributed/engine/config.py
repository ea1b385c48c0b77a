"""The engine's configuration (torch-free)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from torsh_distributed._checks import positive as _positive
from torsh_distributed.checkpoint.config import CheckpointConfig
from torsh_distributed.comm.config import CommConfig
from torsh_distributed.compression.config import CompressionConfig
from torsh_distributed.energy.config import CarbonConfig, EnergyConfig
from torsh_distributed.ft.config import FTConfig
from torsh_distributed.monitor.config import MonitorConfig
from torsh_distributed.parallel.config import ParallelConfig
from torsh_distributed.plan.lr_scaling import RULES as LR_RULES

__all__ = ["EngineConfig", "OptimConfig", "ONEBIT", "OPTIMIZERS", "SCHEDULES"]


OPTIMIZERS = ("adamw", "sgd", "onebit_adam", "zerooneadam")
ONEBIT = ("onebit_adam", "zerooneadam")
"""Optimizers that do their own data-parallel communication (docs/compression.md, "1-bit Adam")."""
SCHEDULES = ("cosine", "linear", "constant")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW (or SGD, 1-bit Adam, 0/1 Adam) with linear warm-up then cosine decay."""

    optimizer: str = "adamw"
    """``adamw`` (``beta1``, ``beta2``, ``eps``) or ``sgd`` (plain, or heavy-ball with ``momentum``). Error
    feedback's guarantees are for SGD: sparse and sign compressors that lag under AdamW train
    like uncompressed SGD (docs/compression.md). ``onebit_adam`` (1-bit Adam: AdamW for
    ``freeze_step`` steps, then frozen variance and the momentum all-reduced in 1-bit codes) and
    ``zerooneadam`` (0/1 Adam: thinning variance updates until ``freeze_step``, then 1-bit
    synchronisations with local steps) replace DDP's gradient all-reduce with their own
    (``--zero-stage 0``, no tp/pp/ep, no ``--compression``)."""
    momentum: float = 0.0
    """SGD momentum in [0, 1) (0 = plain SGD); ``sgd`` only."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay (0.95 suits short LM runs; 0.999 is torch's default)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    lr: float = 3e-3
    """Peak learning rate (SGD needs a larger one than AdamW: 0.5 for the tiny preset)."""
    weight_decay: float = 0.01
    """Weight decay of matrices only (biases and norms are not decayed): decoupled for AdamW,
    L2 for SGD."""
    warmup_steps: int = 10
    """Steps of linear warm-up from 0 to ``lr``."""
    schedule: str = "cosine"
    """After warm-up: ``cosine`` decay, ``linear`` decay (to ``min_lr_ratio * lr`` at
    ``max_steps``) or ``constant``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` at the end of the decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    lr_ref_batch: int = 0
    """The global batch ``lr`` and ``warmup_steps`` were tuned at. When set and the run's
    ``batch_size`` differs, the engine scales ``lr`` by ``lr_scaling``'s rule and keeps the
    warm-up's *samples* (``warmup_steps * lr_ref_batch / batch_size`` steps, rounded up);
    0 = take ``lr`` and ``warmup_steps`` as given."""
    lr_scaling: str = "auto"
    """Rule for ``lr_ref_batch``: ``auto`` (square root for AdamW and the 1-bit Adams, Malladi
    et al. 2022; for SGD linear up to 32x the reference batch, Goyal et al. 2017, square root
    beyond), ``linear`` or ``sqrt``."""
    freeze_step: int = 100
    """``onebit_adam``: steps of fp32 AdamW before the variance freezes and 1-bit momentum
    exchange starts (the paper warms up for 15 to 25 percent of a run). ``zerooneadam``: the last step
    that may update the variance (its ``var_freeze_step``; about the end of the lr warm-up)."""
    var_update_scaler: int = 16
    """``zerooneadam``: variance updates per interval before the interval doubles (kappa)."""
    local_step_scaler: int = 32678
    """``zerooneadam``: steps after the freeze before the interval between synchronisations
    doubles (DeepSpeed's default keeps synchronising every step)."""
    local_step_clipper: int = 16
    """``zerooneadam``: the longest interval between synchronisations (the paper's H)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optim.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optim.momentum must be in [0, 1), got {self.momentum}")
        if self.momentum and self.optimizer != "sgd":
            raise ValueError(
                f"optim.momentum applies to optimizer 'sgd' only (got {self.optimizer!r}, "
                "whose moments are fixed)"
            )
        _positive("optim", "lr", self.lr)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        _positive("optim", "eps", self.eps)
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"optim.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0, got {self.grad_clip}")
        if self.lr_ref_batch < 0:
            raise ValueError(
                f"optim.lr_ref_batch must be >= 0 (0 = no scaling), got {self.lr_ref_batch}"
            )
        if self.lr_scaling not in LR_RULES:
            raise ValueError(
                f"optim.lr_scaling must be one of {', '.join(LR_RULES)}, got {self.lr_scaling!r}"
            )
        for name in ("freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
            _positive("optim", name, getattr(self, name))
            owner = "onebit_adam or zerooneadam" if name == "freeze_step" else "zerooneadam"
            default = OptimConfig.__dataclass_fields__[name].default
            if getattr(self, name) != default and self.optimizer not in owner.split(" or "):
                raise ValueError(
                    f"optim.{name} applies to optimizer {owner} only (got {self.optimizer!r})"
                )


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Everything the engine needs besides the model, loss, optimizer and data: the loop's
    settings and one section per component (each component reads only its own section)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints: directory, intervals, retention, async saving, resume (fault tolerance)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data-parallel sharding: ZeRO stage (DDP by default), offload, mixed precision, checkpointing."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Communication: gradient all-reduce algorithm (facade hook), --trace FILE, debug mode."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Gradient compression (--compression SPEC): DDP's all-reduce, or tp/pp runs' dp exchange."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Observability: --metrics-port, --dashboard-port, --alerts FILE, --report-json FILE."""
    energy: EnergyConfig = field(default_factory=EnergyConfig)
    """Energy meter of every rank: --energy.meter auto|rapl|nvml|estimate|off (docs/energy.md)."""
    carbon: CarbonConfig = field(default_factory=CarbonConfig)
    """Grid carbon intensity: --carbon.intensity G, --carbon.series FILE or --carbon.region CODE."""
    ft: FTConfig = field(default_factory=FTConfig)
    """Fault-tolerant replica groups: --ft.replica-groups R (docs/fault-tolerance.md)."""
    max_steps: int = 200
    """Optimizer steps to run."""
    batch_size: int = 32
    """Global batch (sequences per step), split evenly across data-parallel ranks."""
    grad_accum: int = 1
    """Split each rank's share of the global batch into N micro-batches whose gradients are
    accumulated locally and exchanged once per step (DDP ``no_sync``; FSDP without gradient sync):
    the same global batch and step as N = 1, with about 1/N of the activation memory. Data
    parallelism only (pipelines have ``--microbatches``)."""
    seed: int = 1234
    """Seed for initialisation and for the sample order (the same at every world size)."""
    eval_every: int = 0
    """Evaluate validation loss every N steps (0 = only at the end)."""
    eval_batches: int = 8
    """Validation batches of ``batch_size`` sequences per evaluation."""
    log_every: int = 10
    """Refresh the progress bar's loss/throughput every N steps."""
    backend: str = "auto"
    """Process group backend: ``auto`` (NCCL if every local rank has a GPU; else ``gloo+shm`` for
    several ranks of one host, where shared memory works; else Gloo), ``gloo``, ``nccl``,
    ``gloo+shm`` (shared-memory collectives inside a node, docs/shm.md)."""
    threads: int = 0
    """Torch intra-op threads per rank; 0 = the cores this process may use (its affinity mask)
    divided by local ranks."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    summary_json: str = ""
    """Write the end-of-run summary as JSON to this file (rank 0); empty = do not write."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum", "eval_batches", "log_every"):
            _positive("train", name, getattr(self, name))
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.backend not in ("auto", "gloo", "nccl", "gloo+shm"):
            raise ValueError(
                f"backend must be one of auto, gloo, nccl, gloo+shm; got {self.backend!r}"
            )
        _check_onebit(self)
        _check_schedule(self)
        _check_ft(self)
        if self.carbon.scale and not self.checkpoint.dir:
            raise ValueError(
                "carbon.scale needs --checkpoint.dir DIR: a change of world size restarts the "
                "workers from a checkpoint"
            )

    def check_world(self, dp_size: int) -> int:
        """Per-rank batch for ``dp_size`` data-parallel ranks; ``ValueError`` if it does not divide."""
        if self.batch_size % dp_size:
            raise ValueError(
                f"batch_size {self.batch_size} (global) is not divisible by the {dp_size} "
                f"data-parallel ranks; choose a multiple of {dp_size}"
            )
        per_rank = self.batch_size // dp_size
        if per_rank % self.grad_accum:
            raise ValueError(
                f"grad_accum {self.grad_accum} must divide the per-rank batch {per_rank} "
                f"(batch_size {self.batch_size} / {dp_size} ranks)"
            )
        return per_rank

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Nested config sections: field name -> dataclass type (``model``, ``data``, ...)."""
        sample = cls()
        return {
            f.name: type(getattr(sample, f.name))
            for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(getattr(sample, f.name))
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        kwargs = dict(data)
        for name, section_cls in cls.sections().items():
            if name in kwargs and isinstance(kwargs[name], dict):
                kwargs[name] = _section(section_cls, kwargs[name], name)
        return cls(**kwargs)


def _check_onebit(cfg: EngineConfig) -> None:
    """Refuse the layouts 1-bit Adam / 0/1 Adam cannot serve, naming the alternative."""
    name, par = cfg.optim.optimizer, cfg.parallel
    if name not in ONEBIT:
        return
    instead = "or use --optimizer adamw"
    if par.zero_stage:
        raise ValueError(
            f"--optimizer {name} keeps the whole optimizer state on every rank and all-reduces "
            f"its momentum: it needs --zero-stage 0, got {par.zero_stage} ({instead} with "
            "ZeRO, or with --compression int8 to compress DDP's all-reduce)"
        )
    for axis in ("tp", "pp", "ep"):
        degree = getattr(par, axis)
        if degree > 1:
            raise ValueError(
                f"--optimizer {name} exchanges the momenta of whole data-parallel replicas: it "
                f"cannot run with --{axis} {degree} ({instead}"
                + (
                    " with --compression, which compresses the data-parallel exchange)"
                    if axis != "ep"
                    else ")"
                )
            )
    if cfg.compression.enabled:
        raise ValueError(
            f"--optimizer {name} compresses its own communication: drop --compression "
            f"{cfg.compression.method} ({instead} with it)"
        )
    if cfg.comm.algorithm:
        raise ValueError(
            f"--optimizer {name} replaces DDP's gradient all-reduce: drop --comm-algorithm "
            f"{cfg.comm.algorithm} ({instead} with it)"
        )


def _check_ft(cfg: EngineConfig) -> None:
    """Refuse what replica groups cannot serve yet (each refusal names the setting)."""
    if not cfg.ft.enabled:
        return
    par, groups = cfg.parallel, cfg.ft.replica_groups
    for axis in ("pp", "ep"):
        if getattr(par, axis) > 1:
            raise ValueError(
                f"ft.replica_groups {groups} runs DDP, ZeRO or TP inside each group: it cannot "
                f"run with --{axis} {getattr(par, axis)} yet"
            )
    for what, on in (
        (f"--optimizer {cfg.optim.optimizer}", cfg.optim.optimizer in ONEBIT),
        ("--checkpoint-dir", bool(cfg.checkpoint.dir)),
        ("--carbon.scale", cfg.carbon.scale),
        ("--param-dtype fp16", par.param_dtype == "fp16"),
        ("--comm-schedule priority", cfg.comm.exchange_schedule == "priority"),
    ):
        if on:
            raise ValueError(
                f"ft.replica_groups {groups} does not support {what} yet (its state is not "
                "transferred to a restarted group); drop it or use ft.replica_groups 1"
            )
    if cfg.batch_size % groups:
        raise ValueError(
            f"batch_size {cfg.batch_size} is not divisible by ft.replica_groups {groups}"
        )


def _check_schedule(cfg: EngineConfig) -> None:
    """``--comm-schedule priority`` replaces DDP: refuse what it cannot serve, naming it."""
    if cfg.comm.exchange_schedule != "priority":
        return
    par = cfg.parallel
    if par.zero_stage == 2:  # the exchange shards by itself (parallel._priority_zero)
        zero2 = [
            (cfg.optim.grad_clip > 0, f"--grad-clip {cfg.optim.grad_clip} (use --grad-clip 0)"),
            (bool(cfg.checkpoint.dir), "--checkpoint-dir (its optimizer state lives in shards)"),
            (par.param_dtype != "fp32", f"--param-dtype {par.param_dtype}"),
            (par.offload != "none", f"--offload {par.offload}"),
            (par.meta_init, "--meta-init (FSDP2 draws per-shard weights)"),
        ]
        for clash, flag in zero2:
            if clash:
                raise ValueError(
                    f"--comm-schedule priority with --zero-stage 2 shards the exchange itself; "
                    f"it cannot run with {flag} (use --comm-schedule fifo)"
                )
    clashes = [
        (par.zero_stage not in (0, 2), f"--zero-stage {par.zero_stage}"),
        (par.tp > 1, f"--tp {par.tp}"),
        (par.pp > 1, f"--pp {par.pp}"),
        (par.ep > 1, f"--ep {par.ep}"),
        (cfg.compression.enabled, f"--compression {cfg.compression.method}"),
        (cfg.optim.optimizer in ONEBIT, f"--optimizer {cfg.optim.optimizer}"),
        (bool(cfg.comm.algorithm), f"--comm-algorithm {cfg.comm.algorithm}"),
        (par.param_dtype == "fp16", "--param-dtype fp16 (loss scaling)"),
    ]
    for clash, flag in clashes:
        if clash:
            raise ValueError(
                f"--comm-schedule priority schedules plain data parallelism's exchange "
                f"(--zero-stage 0 or 2, no tp/pp/ep, compression, 1-bit optimizer, comm algorithm "
                f"or fp16); it cannot run with {flag} (use --comm-schedule fifo)"
            )


def _section(cls: type, values: dict[str, Any], name: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown {name} config keys: {sorted(unknown)}")
    return cls(**values)
