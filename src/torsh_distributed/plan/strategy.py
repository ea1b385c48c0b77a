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
from torsh_distributed.plan._strategy_config import DEVICE_PEAK_FLOPS, StrategyConfig
from torsh_distributed.plan.lr_scaling import LRScaling, lr_scaling
from torsh_distributed.plan.memory import format_bytes

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

CLOSE = 0.02
"""Runners-up predicted within this fraction of the best step time are flagged as a tie within
the model's accuracy (it ignores overlap, kernel efficiency and imbalance)."""


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
        for pp in range(1, cfg.layers + 1) if cfg.uneven_stages else _divisors(cfg.layers):
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
            + ("" if cfg.uneven_stages else " (--uneven-stages lifts that)")
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
