"""Per-rank step metrics at low cost, and their aggregation across ranks in one collective.

Each rank keeps running sums of its step phases between aggregations (a few ``perf_counter``
calls per step, no tensors, no syscalls). Every ``every`` steps, :func:`gather` packs the window's
means into one small float64 tensor and all-gathers it: the only communication monitoring adds.
:func:`aggregate` then derives min / median / max and the slowest rank from the gathered matrix.

The slowest rank is the one with the largest *busy* time (step time minus time spent waiting on
communication): under data parallelism every rank's total step time is the same (the fast ranks
wait for the slow one inside the gradient all-reduce), so only the busy time tells them apart.

Custom metrics (:meth:`StepMonitor.log <torsh_distributed.monitor.step.StepMonitor.log>`) ride in
the same tensor: their columns follow :data:`FIELDS`, named ``custom.<name>`` in each rank's row.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import torch.distributed as dist

__all__ = [
    "CUSTOM_PREFIX",
    "FIELDS",
    "PHASES",
    "WindowStats",
    "Aggregate",
    "aggregate",
    "gather",
    "rss_bytes",
    "memory_limit_bytes",
]

PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "comm_wait")
"""Parts of a step; ``comm_wait`` is time blocked in communication that did not overlap compute."""

FIELDS: tuple[str, ...] = (
    "step",
    "step_time",
    *PHASES,
    "samples_per_s",
    "tokens_per_s",
    "rss_bytes",
    "cuda_bytes",
    "loss",
    "grad_norm",
    "lr",
    "comm_bytes",
    "comm_time",
)
"""Columns of the gathered tensor: one row per rank, window means (phases in seconds per step)."""

CUSTOM_PREFIX = "custom."
"""Prefix of custom metric columns in :attr:`Aggregate.ranks` and of their keys in :meth:`Aggregate.flat`."""


@dataclass(slots=True)
class WindowStats:
    """Running sums of one rank between two aggregations."""

    steps: int = 0
    step_time: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    samples: int = 0
    tokens: int = 0
    loss: Any = float("nan")
    """Last step's loss: a float, or a 0-d tensor until the aggregation converts it."""
    grad_norm: Any = float("nan")
    """Last step's gradient norm: a float, or a 0-d tensor until the aggregation converts it."""
    lr: float = float("nan")
    comm_bytes: float = 0.0
    comm_time: float = 0.0

    def add_step(self, step_time: float, phases: dict[str, float], *, samples: int, tokens: int) -> None:
        self.steps += 1
        self.step_time += step_time
        for name, value in phases.items():
            self.phases[name] += value
        self.samples += samples
        self.tokens += tokens

    def row(self, *, step: int, rss: float, cuda: float) -> list[float]:
        """This window as one row of :data:`FIELDS` (means per step; rates over busy wall time)."""
        n = max(self.steps, 1)
        rate = 1.0 / self.step_time if self.step_time > 0 else 0.0
        values = {
            "step": float(step),
            "step_time": self.step_time / n,
            **{name: self.phases[name] / n for name in PHASES},
            "samples_per_s": self.samples * rate,
            "tokens_per_s": self.tokens * rate,
            "rss_bytes": rss,
            "cuda_bytes": cuda,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "comm_bytes": self.comm_bytes / n,
            "comm_time": self.comm_time / n,
        }
        return [values[name] for name in FIELDS]


@dataclass(frozen=True, slots=True)
class Aggregate:
    """One aggregation: every rank's row plus statistics across ranks."""

    step: int
    ranks: list[dict[str, float]]
    """Per rank (index = rank): field -> window mean (``custom.<name>`` for custom metrics)."""
    custom: tuple[str, ...] = ()
    """Names of the custom metrics, in column order (without the ``custom.`` prefix)."""

    def column(self, name: str) -> list[float]:
        return [r[name] for r in self.ranks]

    def stat(self, name: str) -> dict[str, float]:
        """``min``, ``median``, ``max`` of a field across ranks (NaN rows ignored)."""
        values = [v for v in self.column(name) if v == v]
        if not values:
            nan = float("nan")
            return {"min": nan, "median": nan, "max": nan}
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    def custom_stat(self, name: str) -> dict[str, float]:
        """``mean``, ``min``, ``max`` across ranks of custom metric ``name`` (ranks that logged
        nothing in the window are ignored; all NaN when none did)."""
        values = [v for v in self.column(CUSTOM_PREFIX + name) if v == v]
        if not values:
            nan = float("nan")
            return {"mean": nan, "min": nan, "max": nan}
        return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}

    @property
    def busy(self) -> list[float]:
        """Per rank: step time minus communication wait (the work that rank itself did)."""
        return [max(r["step_time"] - r["comm_wait"], 0.0) for r in self.ranks]

    @property
    def slowest_rank(self) -> int:
        busy = self.busy
        return max(range(len(busy)), key=busy.__getitem__)

    @property
    def imbalance(self) -> float:
        """Busy time of the slowest rank over the median busy time (1.0 = perfectly balanced)."""
        busy = self.busy
        median = statistics.median(busy)
        return max(busy) / median if median > 0 else 1.0

    @property
    def tokens_per_s(self) -> float:
        """All ranks together."""
        return sum(v for v in self.column("tokens_per_s") if v == v)

    @property
    def samples_per_s(self) -> float:
        return sum(v for v in self.column("samples_per_s") if v == v)

    def flat(self) -> dict[str, float]:
        """Scalar view for alert rules and anomaly detection: ``<field>_<min|median|max>`` and more."""
        out: dict[str, float] = {"step": float(self.step)}
        for name in FIELDS[1:]:
            for key, value in self.stat(name).items():
                out[f"{name}_{key}"] = value
        out["loss"] = out["loss_median"]
        out["lr"] = out["lr_median"]
        out["step_time"] = out["step_time_max"]
        out["tokens_per_s"] = self.tokens_per_s
        out["samples_per_s"] = self.samples_per_s
        out["slowest_rank"] = float(self.slowest_rank)
        out["imbalance"] = self.imbalance
        step_time = out["step_time_median"]
        out["comm_share"] = out["comm_wait_median"] / step_time if step_time > 0 else 0.0
        out["data_share"] = out["data_median"] / step_time if step_time > 0 else 0.0
        for name in self.custom:
            for key, value in self.custom_stat(name).items():
                out[f"{CUSTOM_PREFIX}{name}_{key}"] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "slowest_rank": self.slowest_rank,
            "imbalance": self.imbalance,
            "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s,
            "ranks": self.ranks,
        }


def aggregate(rows: torch.Tensor | list[list[float]], *, custom: Sequence[str] = ()) -> Aggregate:
    """Build an :class:`Aggregate` from the gathered ``[world_size, len(FIELDS) + len(custom)]`` matrix.

    Args:
        rows: One row per rank: the :data:`FIELDS`, then one column per custom metric.
        custom: Names of the custom metric columns, in order.
    """
    columns = (*FIELDS, *(CUSTOM_PREFIX + name for name in custom))
    matrix = rows.tolist() if isinstance(rows, torch.Tensor) else rows
    if not matrix or any(len(r) != len(columns) for r in matrix):
        extra = f" + {len(custom)} custom" if custom else ""
        raise ValueError(f"expected rows of {len(FIELDS)}{extra} fields ({', '.join(columns)})")
    ranks = [dict(zip(columns, map(float, r), strict=True)) for r in matrix]
    return Aggregate(step=int(max(r["step"] for r in ranks)), ranks=ranks, custom=tuple(custom))


def gather(row: list[float], *, device: torch.device | None = None, custom: Sequence[str] = ()) -> Aggregate:
    """All-gather one row per rank (collective on the default group) and aggregate.

    Every rank must pass rows of the same length (the same ``custom`` names): the all-gather
    cannot tell a mismatch from a bug.
    """
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        matrix = torch.stack(parts).cpu()
    else:
        matrix = mine.cpu().unsqueeze(0)
    return aggregate(matrix, custom=custom)


def rss_bytes() -> float:
    """Resident set size of this process now (psutil)."""
    return float(psutil.Process().memory_info().rss)


# cgroup v2, then v1. psutil reports the machine's memory, not the container's limit, which is
# what an out-of-memory kill is measured against; so the limit is read by hand.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit_bytes() -> float:
    """Memory available to this machine's processes: the cgroup limit if set, else physical RAM."""
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 writes "unlimited" as a huge number
            return float(text)
    return float(psutil.virtual_memory().total)
