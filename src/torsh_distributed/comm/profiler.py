"""Record every collective of the facade; per-rank summary and a merged, time-aligned Chrome trace.

Off by default; when off, the facade pays one ``is None`` check per call. Bandwidths follow
nccl-tests: ``algbw = bytes / time`` and ``busbw = algbw * factor`` with the factors of
:func:`busbw_factor` (so that busbw of a bandwidth-optimal algorithm equals the link rate).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torsh_distributed.comm import _hot

__all__ = [
    "Event",
    "Profiler",
    "busbw_factor",
    "enable",
    "disable",
    "active",
    "clock_offset_us",
    "write_merged_trace",
]


def busbw_factor(op: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` on ``ranks`` ranks."""
    n = max(ranks, 1)
    if op in ("all_reduce", "all_reduce_coalesced"):
        return 2 * (n - 1) / n
    if op in (
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
    ):
        return (n - 1) / n
    return 1.0


@dataclass(slots=True)
class Event:
    """One collective as seen by this rank."""

    op: str
    nbytes: int
    group: str
    ranks: int
    algorithm: str
    start_us: float
    """Wall-clock start, microseconds since the epoch (this rank's clock)."""
    dur_us: float

    @property
    def algbw(self) -> float:
        """Bytes per second."""
        return self.nbytes / (self.dur_us * 1e-6) if self.dur_us > 0 else 0.0

    @property
    def busbw(self) -> float:
        return self.algbw * busbw_factor(self.op, self.ranks)


@dataclass(slots=True)
class Profiler:
    """Collects :class:`Event` records; one per process while enabled."""

    events: list[Event] = field(default_factory=list)
    _anchor_wall_us: float = field(default_factory=lambda: time.time_ns() / 1e3)
    _anchor_perf: float = field(default_factory=time.perf_counter)

    def now_us(self) -> float:
        """Wall-clock microseconds from a monotonic clock (no jumps during the run)."""
        return self._anchor_wall_us + (time.perf_counter() - self._anchor_perf) * 1e6

    def record(
        self, op: str, nbytes: int, group: str, ranks: int, algorithm: str, start_us: float
    ) -> None:
        self.events.append(
            Event(op, nbytes, group, ranks, algorithm, start_us, self.now_us() - start_us)
        )

    def summary(self) -> list[dict[str, Any]]:
        """Per (op, group, algorithm): calls, bytes, total/mean/p50 time and mean bandwidths."""
        rows: dict[tuple[str, str, str], list[Event]] = {}
        for e in self.events:
            rows.setdefault((e.op, e.group, e.algorithm), []).append(e)
        out = []
        for (op, group, algo), evs in sorted(rows.items()):
            durs = [e.dur_us for e in evs]
            total_s = sum(durs) * 1e-6
            nbytes = sum(e.nbytes for e in evs)
            algbw = nbytes / total_s if total_s > 0 else 0.0
            out.append(
                {
                    "op": op,
                    "group": group,
                    "algorithm": algo,
                    "calls": len(evs),
                    "bytes": nbytes,
                    "total_ms": total_s * 1e3,
                    "mean_us": statistics.fmean(durs),
                    "p50_us": statistics.median(durs),
                    "algbw_MBps": algbw / 1e6,
                    "busbw_MBps": algbw * busbw_factor(op, evs[0].ranks) / 1e6,
                }
            )
        return out

    def format_summary(self) -> str:
        lines = [
            f"{'op':<22}{'group':<12}{'algo':<13}{'calls':>7}{'MB':>10}{'ms':>10}{'busbw MB/s':>12}"
        ]
        for r in self.summary():
            lines.append(
                f"{r['op']:<22}{r['group']:<12}{r['algorithm']:<13}{r['calls']:>7}"
                f"{r['bytes'] / 1e6:>10.2f}{r['total_ms']:>10.1f}{r['busbw_MBps']:>12.1f}"
            )
        return "\n".join(lines)

    def chrome_events(self, rank: int, offset_us: float = 0.0) -> list[dict[str, Any]]:
        """Chrome trace events of this rank (one process row per rank), shifted by ``-offset_us``."""
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
        ]
        for e in self.events:
            args = asdict(e)
            args.update(algbw_MBps=e.algbw / 1e6, busbw_MBps=e.busbw / 1e6)
            out.append(
                {
                    "name": e.op,
                    "cat": "comm",
                    "ph": "X",
                    "pid": rank,
                    "tid": e.group,
                    "ts": e.start_us - offset_us,
                    "dur": e.dur_us,
                    "args": args,
                }
            )
        return out


_ACTIVE: Profiler | None = None


def enable() -> Profiler:
    """Start recording (idempotent); returns the process's :class:`Profiler`."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = Profiler()
        _hot.invalidate()
    return _ACTIVE


def disable() -> Profiler | None:
    """Stop recording; returns what was recorded."""
    global _ACTIVE
    prof, _ACTIVE = _ACTIVE, None
    _hot.invalidate()
    return prof


def active() -> Profiler | None:
    return _ACTIVE


def clock_offset_us(*, rounds: int = 5) -> float:
    """This rank's clock minus rank 0's, in microseconds (collective; median over barrier rounds)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    samples = []
    for _ in range(rounds):
        dist.barrier()
        mine = time.time_ns() / 1e3
        gathered: list[float] = [0.0] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        samples.append(mine - gathered[0])
    return statistics.median(samples)


def write_merged_trace(
    path: str | os.PathLike[str], profiler: Profiler | None = None
) -> Path | None:
    """Gather every rank's events to rank 0 and write one Chrome trace there (collective).

    Timestamps are aligned to rank 0's clock with :func:`clock_offset_us`. Returns the path on
    rank 0, ``None`` elsewhere. Load the file in https://ui.perfetto.dev or chrome://tracing.
    """
    prof = profiler or _ACTIVE or Profiler()
    rank = dist.get_rank() if dist.is_initialized() else 0
    offset = clock_offset_us()
    mine = prof.chrome_events(rank, offset)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everything: list[Any] = [None] * dist.get_world_size() if rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, everything, dst=0)
    else:
        everything = [mine]
    if rank != 0:
        return None
    events = [e for part in everything for e in part]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    tmp.replace(out)
    return out
