"""The end-of-run bottleneck report: where step time goes, which rank is slow, what to change.

Rules (each finding carries concrete recommendations with the trainer flags to try):

* communication wait of the slowest rank (or its profiled collective time) > 30 % of its step -> gradient compression, larger buckets, hierarchical
  all-reduce;
* memory at or above 85 % of the limit -> a higher ZeRO stage, activation checkpointing, offload;
* data loading > 10 % of the step on any rank -> more loader workers / prefetching;
* busy-time imbalance > 1.2x (slowest rank over the median) -> name the slowest rank;
* anomalies found by the z-score detector are listed.

Custom metrics (``StepMonitor.log``) are summarised, not judged: ``custom[name]`` holds the last
cross-rank mean and the mean / min / max over the whole run (warm-up included: they are the
user's numbers, not timings).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from torsh_distributed.monitor.anomaly import Anomaly
from torsh_distributed.monitor.metrics import PHASES, Aggregate

__all__ = ["Finding", "Report", "build_report", "THRESHOLDS"]

THRESHOLDS = {"comm_share": 0.30, "memory_share": 0.85, "data_share": 0.10, "imbalance": 1.20}
"""Limits of the report rules (fractions of step time / of the memory limit; ratio for imbalance)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One bottleneck with what to do about it."""

    kind: str
    """``communication``, ``memory``, ``data``, ``imbalance`` or ``anomaly``."""
    severity: str
    message: str
    recommendations: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "severity": self.severity, "message": self.message,
                "recommendations": list(self.recommendations)}


@dataclass(slots=True)
class Report:
    """Everything the report says; :meth:`to_dict` is the ``--report-json`` content."""

    steps: int
    world_size: int
    breakdown: dict[str, float]
    """Median across ranks of each phase's mean seconds per step (and ``step_time``)."""
    per_rank: list[dict[str, float]]
    """Per rank: mean ``step_time``, ``busy`` and ``comm_wait`` seconds per step."""
    slowest_rank: int
    imbalance: float
    tokens_per_s: float
    memory: dict[str, float]
    findings: list[Finding]
    anomalies: list[dict[str, Any]]
    alerts: dict[str, Any] = field(default_factory=dict)
    comm: list[dict[str, Any]] = field(default_factory=list)
    slowest_by_step: list[list[int]] = field(default_factory=list)
    """``[step, slowest rank]`` of every aggregation (the warm-up one included)."""
    samples_per_s: float = 0.0
    """Mean over the run's aggregations of the job's samples per second."""
    first_step: int = 1
    """The first step measured (after a resume: the step after the checkpoint's)."""
    custom: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per custom metric: ``last`` (cross-rank mean of the last aggregation), ``mean`` (of the
    cross-rank means over every aggregation), ``min`` and ``max`` (over ranks and aggregations)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "world_size": self.world_size, "breakdown": self.breakdown,
            "per_rank": self.per_rank, "slowest_rank": self.slowest_rank,
            "imbalance": self.imbalance, "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s, "first_step": self.first_step,
            "memory": self.memory, "findings": [f.to_dict() for f in self.findings],
            "anomalies": self.anomalies, "alerts": self.alerts, "comm": self.comm,
            "slowest_by_step": self.slowest_by_step, "custom": self.custom,
        }

    def format(self) -> str:
        """A readable block for the end of the run."""
        step = self.breakdown.get("step_time", 0.0) or float("nan")
        parts = ", ".join(
            f"{p} {self.breakdown[p] * 1e3:.1f} ms ({self.breakdown[p] / step:.0%})" for p in PHASES
        )
        lines = [
            f"bottleneck report (steps {self.first_step}-{self.steps}, {self.world_size} ranks)",
            f"  step time {step * 1e3:.1f} ms (median rank): {parts}",
            f"  slowest rank: {self.slowest_rank} (busy time {self.imbalance:.2f}x the median); "
            f"throughput {self.samples_per_s:,.1f} samples/s"
            + (f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else ""),
        ]
        if len(self.per_rank) <= 16:
            lines.append("  per rank (ms/step busy / comm wait): " + ", ".join(
                f"r{p['rank']} {p['busy'] * 1e3:.1f} / {p['comm_wait'] * 1e3:.1f}" for p in self.per_rank
            ))
        if self.custom:
            lines.append("  custom metrics (last mean across ranks; min..max over the run): " + ", ".join(
                f"{name} {s['last']:.4g} ({s['min']:.4g}..{s['max']:.4g})" for name, s in self.custom.items()
            ))
        if not self.findings:
            lines.append("  no bottleneck found")
        for f in self.findings:
            lines.append(f"  [{f.severity}] {f.kind}: {f.message}")
            lines.extend(f"      -> {r}" for r in f.recommendations)
        return "\n".join(lines)


def _mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.fmean(values) if values else 0.0


def _custom_summary(history: list[Aggregate]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    nan = float("nan")
    for name in history[-1].custom:
        stats = [a.custom_stat(name) for a in history if name in a.custom]
        means = [s["mean"] for s in stats if s["mean"] == s["mean"]]
        lows = [s["min"] for s in stats if s["min"] == s["min"]]
        highs = [s["max"] for s in stats if s["max"] == s["max"]]
        out[name] = {
            "last": stats[-1]["mean"],
            "mean": statistics.fmean(means) if means else nan,
            "min": min(lows) if lows else nan,
            "max": max(highs) if highs else nan,
        }
    return out


def build_report(
    history: list[Aggregate],
    *,
    memory_limit: float,
    cuda_limit: float = 0.0,
    local_world_size: int = 1,
    anomalies: list[Anomaly] | None = None,
    alerts: dict[str, Any] | None = None,
    comm: list[dict[str, Any]] | None = None,
    thresholds: dict[str, float] | None = None,
    first_step: int = 1,
) -> Report:
    """Apply the report rules to the aggregations of a run.

    Args:
        history: Aggregations, oldest first; the first is skipped when there are several
            (warm-up steps distort every mean).
        memory_limit: Host bytes available to this node (cgroup limit or RAM); NaN/0 = unknown.
        cuda_limit: Bytes of one GPU; 0 on CPU.
        local_world_size: Ranks sharing ``memory_limit`` (their RSS adds up).
        anomalies: Found by the detector, listed as findings.
        alerts: Alert statistics, copied into the report.
        comm: Collective summary of the comm profiler, when it ran.
        thresholds: Overrides of :data:`THRESHOLDS`.
        first_step: The first step this run measured (1, or the step after a resume's).
    """
    if not history:
        raise ValueError("build_report needs at least one aggregation")
    limits = {**THRESHOLDS, **(thresholds or {})}
    window = history[1:] if len(history) > 1 else history
    world = len(window[-1].ranks)
    per_rank = []
    for r in range(world):
        rows = [a.ranks[r] for a in window]
        step_time = _mean([x["step_time"] for x in rows])
        wait = _mean([x["comm_wait"] for x in rows])
        per_rank.append({"rank": r, "step_time": step_time, "busy": max(step_time - wait, 0.0),
                         "comm_wait": wait, "data": _mean([x["data"] for x in rows])})
    breakdown = {
        name: statistics.median(_mean([a.ranks[r][name] for a in window]) for r in range(world))
        for name in ("step_time", *PHASES)
    }
    busy = [p["busy"] for p in per_rank]
    slowest = max(range(world), key=busy.__getitem__)
    median_busy = statistics.median(busy)
    imbalance = busy[slowest] / median_busy if median_busy > 0 else 1.0
    rss_max = max(max(a.column("rss_bytes")) for a in window)
    cuda_max = max(max(a.column("cuda_bytes")) for a in window)
    host_share = rss_max * local_world_size / memory_limit if memory_limit > 0 else 0.0
    cuda_share = cuda_max / cuda_limit if cuda_limit > 0 else 0.0
    used, limit = (
        (rss_max * local_world_size, memory_limit) if host_share >= cuda_share else (cuda_max, cuda_limit)
    )
    memory = {"rss_bytes_max": rss_max, "cuda_bytes_max": cuda_max, "limit_bytes": memory_limit,
              "cuda_limit_bytes": cuda_limit, "share": max(host_share, cuda_share)}
    step = breakdown["step_time"] or float("nan")
    findings = []
    # The slowest rank waits for nobody: its wait is the communication itself (the other ranks'
    # extra wait is imbalance, reported below). Profiled collective time counts too: a blocking
    # comm hook runs inside backward.
    own = per_rank[slowest]
    comm_time = _mean([a.ranks[slowest]["comm_time"] for a in window])
    comm_share = max(own["comm_wait"], comm_time) / own["step_time"] if own["step_time"] > 0 else 0.0
    if comm_share > limits["comm_share"]:
        findings.append(Finding(
            "communication", "warning",
            f"{comm_share:.0%} of the step waits on communication, even on the slowest rank "
            f"{slowest} (limit {limits['comm_share']:.0%})",
            ["compress gradients: --compression powersgd:4 (or fp16, topk:0.01; see docs/compression.md)",
             "use larger all-reduce buckets: --bucket-cap-mb 100 (fewer, bigger messages)",
             "use a hierarchical all-reduce across nodes: --comm-algorithm hierarchical",
             "raise the work per step (larger --batch-size) so compute hides communication"],
        ))
    if memory["share"] >= limits["memory_share"]:
        findings.append(Finding(
            "memory", "critical" if memory["share"] >= 0.95 else "warning",
            f"memory use {memory['share']:.0%} of the limit ({used / 2**30:.2f} of "
            f"{limit / 2**30:.2f} GiB{' of GPU memory' if limit == cuda_limit else ''})",
            ["shard optimizer states, gradients and parameters: --zero-stage 1, 2 or 3",
             "recompute activations in backward: --activation-checkpointing full (or every-2)",
             "offload sharded states to host memory: --parallel.offload cpu (with --zero-stage 2 or 3)"],
        ))
    data_rank = max(range(world), key=lambda r: per_rank[r]["data"])
    data_share = per_rank[data_rank]["data"] / step
    if data_share > limits["data_share"]:
        where = f"rank {data_rank} spends" if world > 1 else "the step spends"
        findings.append(Finding(
            "data", "warning",
            f"{where} {data_share:.0%} of the step waiting on data (limit {limits['data_share']:.0%})",
            ["use more data-loader workers (DataLoader num_workers) and pin_memory",
             "prefetch the next batch while the current one trains",
             "pre-tokenize or cache the dataset so loading does less work per step"],
        ))
    if world > 1 and imbalance > limits["imbalance"]:
        findings.append(Finding(
            "imbalance", "warning",
            f"rank {slowest} is the slowest: busy {busy[slowest] * 1e3:.1f} ms per step, "
            f"{imbalance:.2f}x the median {median_busy * 1e3:.1f} ms; the other ranks wait for it",
            [f"check rank {slowest}'s host: CPU contention, thermal throttling, a slower device",
             f"check rank {slowest}'s data: larger or slower-to-load samples",
             "uneven work per rank: balance the batch split (--batch-size divisible evenly)"],
        ))
    for anomaly in anomalies or []:
        findings.append(Finding("anomaly", "info", anomaly.describe()))
    return Report(
        steps=int(window[-1].step), world_size=world, breakdown=breakdown, per_rank=per_rank,
        slowest_rank=slowest, imbalance=imbalance,
        tokens_per_s=_mean([a.tokens_per_s for a in window]), memory=memory, findings=findings,
        samples_per_s=_mean([a.samples_per_s for a in window]), first_step=first_step,
        anomalies=[a.to_dict() for a in anomalies or []], alerts=alerts or {}, comm=comm or [],
        slowest_by_step=[[a.step, a.slowest_rank] for a in history],
        custom=_custom_summary(history),
    )
