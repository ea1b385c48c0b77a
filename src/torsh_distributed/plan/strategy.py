"""Strategy planner: dp / tp / pp / ep degrees, ZeRO stage, micro-batch and lr rule for a cluster.

:func:`plan_strategy` enumerates every layout the constraints allow (``dp * tp * pp * ep`` equals
the devices; tp inside a node and dividing the heads; pp dividing the layers; ep dividing the
experts; the global batch divisible by the data-parallel replicas and their micro-batches),
predicts each one's memory per device and step time (:mod:`._cost`: the ZeRO paper's model-state
formulas, Korthikanti et al.'s activation count, an alpha-beta ring model of the collectives,
the 1F1B bubble; or, given a measured :class:`~.profile.Profile`, per-block, optimizer and
collective times profiled on the target machine) and ranks them: the fastest layout that fits
wins; equal predicted step times go to the one holding less memory. Every runner-up carries
the reason it lost. See docs/planner.md for what is modelled and what is not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torsh_distributed.plan._cost import Estimate, Layout, estimate
from torsh_distributed.plan.lr_scaling import LRScaling, lr_scaling
from torsh_distributed.plan.memory import DTYPES, OPTIMIZERS, format_bytes
from torsh_distributed.plan.profile import Profile

__all__ = [
    "CLOSE",
    "DEVICE_PEAK_FLOPS",
    "Candidate",
    "StrategyConfig",
    "StrategyPlan",
    "evaluate_layout",
    "explain",
    "plan_strategy",
]

DEVICE_PEAK_FLOPS = {"v100": 125e12, "a100": 312e12, "h100": 989e12, "h200": 989e12}
"""Dense 16-bit tensor-core peak per device (NVIDIA data sheets); ``cpu`` has none: measure it."""
_AC = ("auto", "none", "full")
CLOSE = 0.02
"""Runners-up predicted within this fraction of the best step time are flagged as a tie within
the model's accuracy (it ignores overlap, kernel efficiency and imbalance)."""
_LAYOUTS = ("paper", "fsdp2")


@dataclass(kw_only=True, slots=True)
class StrategyConfig:
    """A model, a cluster and a batch to plan for. Errors name the CLI flag of the field."""

    params: float
    """Parameters of the model (all experts included)."""
    layers: int
    """Transformer layers (pp must divide them)."""
    hidden: int
    """Width of the residual stream."""
    heads: int
    """Attention heads (tp must divide them)."""
    devices: int
    """Accelerators in the job."""
    device_memory: float
    """Bytes of memory per device."""
    intra_bw: float
    """Bytes/s between two devices of a node (NVLink/NVSwitch), per device."""
    inter_bw: float
    """Bytes/s out of one node (all its NICs together); the node's devices share it."""
    nodes: int = 1
    """Nodes the devices are spread over, evenly."""
    intra_latency: float = 5e-6
    """Seconds per message inside a node (the alpha of the alpha-beta model)."""
    inter_latency: float = 1e-5
    """Seconds per message between nodes."""
    seq_len: int = 2048
    """Tokens per sequence."""
    vocab: int = 51200
    """Vocabulary size (logits width)."""
    global_batch: int = 0
    """Sequences per optimizer step; 0 = one per device."""
    dtype: str = "bf16"
    """``fp32``, or ``bf16``/``fp16`` mixed precision (fp32 master copy)."""
    optimizer: str = "adam"
    """``adam``, ``sgd`` (momentum) or ``sgd-plain``: optimizer-state bytes and the lr rule."""
    experts: int = 0
    """Experts per MoE layer (every layer, each ``4 * hidden`` wide); 0 = dense."""
    top_k: int = 1
    """Experts per token (MoE only)."""
    device: str = "a100"
    """Device kind for the default FLOP rate: v100, a100, h100, h200, or cpu (needs device_flops)."""
    device_flops: float = 0.0
    """Achieved FLOP/s per device; 0 = the kind's dense 16-bit peak times ``mfu``."""
    mfu: float = 0.5
    """Fraction of peak achieved when ``device_flops`` is 0 (Megatron-LM 2021 reports 0.44-0.52)."""
    activation_checkpointing: str = "auto"
    """``auto`` (recompute only where it is needed to fit), ``none`` or ``full``."""
    layout: str = "paper"
    """``paper``: the ZeRO paper's / DeepSpeed's accounting; ``fsdp2``: this package's
    DDP/FSDP2 (fp32 shards, bucket and gather transients, the optimizer's temporary)."""
    flash_attention: bool = True
    """Attention scores are not saved (flash / memory-efficient attention)."""
    dropout: bool = False
    """Dropout masks are saved (1 byte per element)."""
    reserve: float = 1e9
    """Bytes per device not available to the model (CUDA context, communication buffers)."""
    max_micro_batch: int = 64
    """Largest micro-batch (sequences) considered."""
    tp: int = 0
    """Pin the tensor-parallel degree (0 = search)."""
    pp: int = 0
    """Pin the pipeline-parallel degree (0 = search; 1 = no pipeline, e.g. a system without it)."""
    ep: int = 0
    """Pin the expert-parallel degree (0 = search)."""
    stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages considered."""
    pp_scatter_gather: bool = False
    """Pipeline sends split over the tp ranks and gathered over the intra-node link
    (Narayanan et al. 2021, section 4.1): a ``tp`` times smaller inter-node message."""
    ref_batch: int = 0
    """Global batch the reference lr was tuned at; 0 = the global batch (no scaling)."""
    ref_lr: float | None = None
    """The reference lr, to report the scaled one."""
    ref_warmup_steps: int = 0
    """Warm-up steps of the reference run (kept constant in samples)."""
    profile: Profile | None = None
    """Measured block, optimizer and collective times of this model on the target machine
    (profile-guided mode, see :mod:`.profile`); ``None`` = the analytic model throughout. Terms
    the profile does not cover keep the analytic formula."""

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise ValueError(f"--params must be > 0, got {self.params}")
        for name in (
            "layers",
            "hidden",
            "heads",
            "devices",
            "nodes",
            "seq_len",
            "vocab",
            "max_micro_batch",
            "top_k",
        ):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        for name in ("device_memory", "intra_bw", "inter_bw"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be > 0, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"--heads ({self.heads}) must divide --hidden ({self.hidden})")
        if self.devices % self.nodes:
            raise ValueError(
                f"--devices ({self.devices}) must be a multiple of --nodes ({self.nodes})"
            )
        if self.global_batch < 0 or self.ref_batch < 0:
            raise ValueError("--global-batch and --ref-batch must be >= 0")
        if self.global_batch == 0:
            self.global_batch = self.devices
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}"
            )
        if self.experts < 0 or (self.experts and self.top_k > self.experts):
            raise ValueError(
                f"--experts must be >= 0 and >= --top-k; got {self.experts} (top-k {self.top_k})"
            )
        if self.device not in (*DEVICE_PEAK_FLOPS, "cpu"):
            kinds = ", ".join((*DEVICE_PEAK_FLOPS, "cpu"))
            raise ValueError(f"--device must be one of {kinds}; got {self.device!r}")
        if self.device_flops < 0 or not 0 < self.mfu <= 1:
            raise ValueError("--device-flops must be >= 0 and --mfu in (0, 1]")
        if not self.device_flops:
            if self.device == "cpu":
                raise ValueError("--device cpu has no known peak: give --device-flops (measured)")
            self.device_flops = DEVICE_PEAK_FLOPS[self.device] * self.mfu
        if self.activation_checkpointing not in _AC:
            raise ValueError(
                f"--activation-checkpointing must be one of {', '.join(_AC)}; "
                f"got {self.activation_checkpointing!r}"
            )
        if self.layout not in _LAYOUTS:
            raise ValueError(f"--layout must be one of {', '.join(_LAYOUTS)}; got {self.layout!r}")
        if self.reserve < 0 or self.intra_latency < 0 or self.inter_latency < 0:
            raise ValueError("--reserve, --intra-latency and --inter-latency must be >= 0")
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0 (0 = search), got {getattr(self, name)}")
        if not self.stages or any(st not in (0, 1, 2, 3) for st in self.stages):
            raise ValueError(f"--stages must lie in 0..3; got {self.stages}")
        if self.experts and 8.0 * self.hidden**2 * self.layers * self.experts >= self.params:
            raise ValueError(
                "--params must exceed the experts' parameters (layers x experts x 8 hidden^2)"
            )
        if self.profile is not None:
            if isinstance(self.profile, dict):
                self.profile = Profile.from_dict(self.profile)
            prof = self.profile
            if (prof.hidden, prof.seq_len) != (self.hidden, self.seq_len):
                raise ValueError(
                    f"--profile was measured at hidden {prof.hidden}, seq-len {prof.seq_len}; "
                    f"this plan has --hidden {self.hidden}, --seq-len {self.seq_len}"
                )

    @property
    def devices_per_node(self) -> int:
        return self.devices // self.nodes


@dataclass(slots=True)
class Candidate:
    """One layout with its predicted memory and time, its rank and why it ranks there."""

    layout: Layout
    estimate: Estimate
    fits: bool
    rank: int = 0
    """1 = the recommendation."""
    reason: str = ""
    """Why the layout is not the recommendation (empty for rank 1)."""

    @property
    def step_time(self) -> float:
        return self.estimate.time["total"]

    @property
    def memory(self) -> float:
        return self.estimate.memory["total"]

    def name(self) -> str:
        lay = self.layout
        parts = [f"dp{lay.dp}", f"tp{lay.tp}", f"pp{lay.pp}"]
        if lay.ep > 1:
            parts.append(f"ep{lay.ep}")
        return " ".join(parts) + f" z{lay.stage}"

    def to_dict(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "name": self.name(),
            **asdict(self.layout),
            "fits": self.fits,
            "memory_bytes": self.estimate.memory,
            "step_time_s": self.estimate.time,
            "reason": self.reason,
        }


@dataclass(slots=True)
class StrategyPlan:
    """Ranked candidates (fitting ones first, by step time), the lr rule and the inputs."""

    config: StrategyConfig
    candidates: list[Candidate]
    lr: LRScaling
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def find(
        self, *, dp: int, tp: int, pp: int, ep: int = 1, stage: int | None = None
    ) -> Candidate:
        """The best-ranked candidate with these degrees (and stage); ``KeyError`` if none."""
        for cand in self.candidates:
            lay = cand.layout
            if (lay.dp, lay.tp, lay.pp, lay.ep) == (dp, tp, pp, ep) and stage in (None, lay.stage):
                return cand
        raise KeyError(f"no candidate dp{dp} tp{tp} pp{pp} ep{ep} stage {stage}")

    def to_dict(self, *, top: int = 10) -> dict[str, object]:
        shown = self.candidates[:top]
        rejected = [c for c in self.candidates[top:] if not c.fits][:3]
        return {
            "inputs": asdict(self.config),
            "recommendation": self.best.to_dict(),
            "explanation": explain(self),
            "lr_scaling": self.lr.to_dict(),
            "candidates": [c.to_dict() for c in shown + rejected],
            "num_candidates": len(self.candidates),
            "notes": self.notes,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _options(cfg: StrategyConfig, per_replica: int) -> list[tuple[int, bool]]:
    micro = [b for b in _divisors(per_replica) if b <= cfg.max_micro_batch]
    ac = {"auto": (False, True), "none": (False,), "full": (True,)}[cfg.activation_checkpointing]
    return [(b, r) for b in micro for r in ac]


def _layouts(cfg: StrategyConfig) -> list[tuple[int, int, int, int]]:
    out = []
    per_node = cfg.devices_per_node
    for tp in _divisors(per_node):
        if cfg.heads % tp or cfg.tp not in (0, tp):
            continue
        for pp in _divisors(cfg.layers):
            if cfg.pp not in (0, pp):
                continue
            for ep in _divisors(cfg.experts) if cfg.experts else [1]:
                if cfg.ep not in (0, ep):
                    continue
                if cfg.devices % (tp * pp * ep):
                    continue
                dp = cfg.devices // (tp * pp * ep)
                if cfg.global_batch % (dp * ep):
                    continue
                out.append((dp, tp, pp, ep))
    return out


def plan_strategy(config: StrategyConfig) -> StrategyPlan:
    """Rank every admissible layout of ``config`` (see the module docstring)."""
    cfg = config
    best_per_layout: list[Candidate] = []
    layouts = _layouts(cfg)
    if not layouts:
        raise ValueError(
            f"no layout satisfies the constraints: --global-batch {cfg.global_batch} must be "
            f"divisible by the data-parallel replicas dp*ep, with dp*tp*pp*ep = --devices "
            f"{cfg.devices}, tp dividing --heads {cfg.heads} and the {cfg.devices_per_node} "
            f"devices per node, pp dividing --layers {cfg.layers}"
            + (
                f" (pinned: tp {cfg.tp}, pp {cfg.pp}, ep {cfg.ep}; 0 = free)"
                if cfg.tp or cfg.pp or cfg.ep
                else ""
            )
        )
    for dp, tp, pp, ep in layouts:
        per_replica = cfg.global_batch // (dp * ep)
        for stage in cfg.stages if dp * ep > 1 else (0,):
            options = []
            for micro, recompute in _options(cfg, per_replica):
                lay = Layout(
                    dp=dp,
                    tp=tp,
                    pp=pp,
                    ep=ep,
                    stage=stage,
                    micro_batch=micro,
                    microbatches=per_replica // micro,
                    recompute=recompute,
                )
                est = estimate(cfg, lay)
                options.append(
                    Candidate(
                        layout=lay, estimate=est, fits=est.memory["total"] <= cfg.device_memory
                    )
                )
            fitting = [c for c in options if c.fits]
            if fitting:  # fastest; ties to the larger micro-batch (better kernel efficiency)
                pick = min(fitting, key=lambda c: (_key(c.step_time), -c.layout.micro_batch))
            else:
                pick = min(options, key=lambda c: c.memory)
            best_per_layout.append(pick)
    ranked = sorted(
        best_per_layout,
        key=lambda c: (not c.fits, _key(c.step_time) if c.fits else c.memory, c.memory),
    )
    for i, cand in enumerate(ranked, 1):
        cand.rank = i
    _reasons(cfg, ranked)
    lr = lr_scaling(
        global_batch=cfg.global_batch,
        reference_batch=cfg.ref_batch or cfg.global_batch,
        optimizer=cfg.optimizer,
        reference_lr=cfg.ref_lr,
        reference_warmup_steps=cfg.ref_warmup_steps,
    )
    notes = []
    if not ranked[0].fits:
        notes.append(
            f"no layout fits in {format_bytes(cfg.device_memory)} per device: more devices, "
            "more memory, or CPU offload (not modelled) are needed"
        )
    return StrategyPlan(config=cfg, candidates=ranked, lr=lr, notes=notes)


def evaluate_layout(
    config: StrategyConfig,
    *,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    stage: int = 0,
    micro_batch: int,
    recompute: bool = False,
) -> Candidate:
    """Predictions for one given layout (no search, no constraint on the batch's split other
    than divisibility): for comparing a run's measured figures with the model."""
    if dp * tp * pp * ep != config.devices:
        raise ValueError(f"dp*tp*pp*ep = {dp * tp * pp * ep} != --devices {config.devices}")
    replicas = dp * ep
    if config.global_batch % (replicas * micro_batch):
        raise ValueError(
            f"--global-batch {config.global_batch} is not divisible by dp*ep*micro-batch "
            f"{replicas * micro_batch}"
        )
    lay = Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        ep=ep,
        stage=stage,
        micro_batch=micro_batch,
        microbatches=config.global_batch // (replicas * micro_batch),
        recompute=recompute,
    )
    est = estimate(config, lay)
    return Candidate(layout=lay, estimate=est, fits=est.memory["total"] <= config.device_memory)


def _key(seconds: float) -> float:
    """Step times equal to 9 significant digits tie (formulas summed in a different order)."""
    return float(f"{seconds:.9g}")


def _describe_memory(cand: Candidate) -> str:
    mem = cand.estimate.memory
    parts = [
        f"model states {format_bytes(mem['model_states'])}",
        f"activations {format_bytes(mem['activations'])}",
    ]
    if mem.get("transient"):
        parts.append(f"transient {format_bytes(mem['transient'])}")
    if mem.get("reserve"):
        parts.append(f"reserve {format_bytes(mem['reserve'])}")
    return ", ".join(parts)


def _reasons(cfg: StrategyConfig, ranked: list[Candidate]) -> None:
    best = ranked[0]
    for cand in ranked[1:]:
        if not cand.fits:
            cand.reason = (
                f"does not fit: {format_bytes(cand.memory)} > {format_bytes(cfg.device_memory)} "
                f"({_describe_memory(cand)})"
            )
            continue
        if not best.fits:
            cand.reason = "does not fit"
            continue
        delta = cand.step_time - best.step_time
        if _key(cand.step_time) == _key(best.step_time):
            cand.reason = (
                f"same predicted step time; holds more memory per device "
                f"({format_bytes(cand.memory)} vs {format_bytes(best.memory)})"
            )
            continue
        diffs = []
        for term, value in cand.estimate.time.items():
            if term == "total":
                continue
            d = value - best.estimate.time[term]
            if abs(d) >= 0.01 * abs(delta):
                diffs.append((abs(d), f"{term.replace('_', ' ')} {d:+.3g} s"))
        detail = ", ".join(text for _, text in sorted(diffs, reverse=True))
        close = delta / best.step_time < CLOSE
        cand.reason = (
            f"slower: {cand.step_time:.3g} s vs {best.step_time:.3g} s per step "
            f"(+{delta / best.step_time:.1%}: {detail})"
            + (f"; within {CLOSE:.0%}: closer than the model can resolve" if close else "")
        )


def explain(plan: StrategyPlan) -> str:
    """Why the recommendation: what it holds, what it spends, what the nearest rivals lack."""
    best = plan.best
    cfg = plan.config
    lay = best.layout
    t = best.estimate.time
    head = (
        f"{best.name()}: micro-batch {lay.micro_batch} x {lay.microbatches} per step"
        f"{', full activation recomputation' if lay.recompute else ''}; "
        f"{format_bytes(best.memory)} of {format_bytes(cfg.device_memory)} per device "
        f"({_describe_memory(best)}); step {t['total']:.3g} s = compute {t['compute']:.3g} + "
        f"communication {t['tp_comm'] + t['ep_comm'] + t['pp_comm'] + t['dp_comm']:.3g} + "
        f"bubble {t['bubble']:.3g}"
        + (f" + optimizer {t['optimizer']:.3g}" if t.get("optimizer") else "")
        + (" (profiled)" if cfg.profile is not None else "")
    )
    if not best.fits:
        return "nothing fits; least memory: " + head
    why = []
    smaller = [c for c in plan.candidates if c.layout.tp * c.layout.pp < lay.tp * lay.pp]
    if smaller and not any(c.fits for c in smaller):
        least = min(smaller, key=lambda c: c.memory)
        why.append(
            f"less model parallelism does not fit (closest: {least.name()}, "
            f"{format_bytes(least.memory)})"
        )
    if lay.recompute and cfg.activation_checkpointing == "auto":
        why.append("recomputation is needed to fit at this layout")
    if lay.stage:
        plain = [
            c
            for c in plan.candidates
            if c.layout.stage == 0
            and (c.layout.dp, c.layout.tp, c.layout.pp, c.layout.ep)
            == (lay.dp, lay.tp, lay.pp, lay.ep)
        ]
        if plain and not plain[0].fits:
            why.append(f"ZeRO-{lay.stage}: stage 0 does not fit ({format_bytes(plain[0].memory)})")
        elif plain and _key(plain[0].step_time) == _key(best.step_time):
            why.append(f"ZeRO-{lay.stage} is predicted as fast as stage 0 and holds less")
    if len(plan.candidates) > 1:
        runner = plan.candidates[1]
        why.append(f"runner-up {runner.name()}: {runner.reason}")
    return head + (". Why: " + "; ".join(why) if why else "")
