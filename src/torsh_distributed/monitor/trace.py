"""A merged, time-aligned Chrome trace of every rank's step phases (and collectives, if profiled).

With ``--monitor-trace FILE`` each rank keeps the phase spans of every step (a tuple per phase,
no tensors); at the end rank 0 gathers them, shifts every rank onto its own clock with the comm
profiler's barrier-based offset, adds the comm profiler's collective events when it ran, and writes
one file for https://ui.perfetto.dev or chrome://tracing: one process row per rank, a "step" lane
with the phases and, below it, the collectives — the slow rank and the waiting ranks side by side.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["PhaseTrace"]


class PhaseTrace:
    """Phase spans of this rank, in wall-clock microseconds of a monotonic clock."""

    def __init__(self) -> None:
        self._anchor_wall_us = time.time_ns() / 1e3
        self._anchor_perf = time.perf_counter()
        self.spans: list[tuple[int, str, float, float]] = []
        """``(step, phase, start perf_counter, end perf_counter)``."""

    def add(self, step: int, phase: str, start: float, end: float) -> None:
        if end > start:
            self.spans.append((step, phase, start, end))

    def _us(self, perf: float) -> float:
        return self._anchor_wall_us + (perf - self._anchor_perf) * 1e6

    def chrome_events(self, rank: int, offset_us: float = 0.0) -> list[dict[str, Any]]:
        """This rank's events (one process row), shifted by ``-offset_us`` onto rank 0's clock."""
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": "step", "args": {"name": "step phases"}},
        ]
        for step, phase, start, end in self.spans:
            out.append({
                "name": phase, "cat": "step", "ph": "X", "pid": rank, "tid": "step",
                "ts": self._us(start) - offset_us, "dur": (end - start) * 1e6,
                "args": {"step": step},
            })
        return out

    def write_merged(self, path: str | os.PathLike[str]) -> Path | None:
        """Gather every rank's spans (and profiled collectives) to rank 0 and write the file.

        Collective: every rank must call it. Returns the path on rank 0, ``None`` elsewhere.
        """
        from torsh_distributed.comm import profiler

        rank = dist.get_rank() if dist.is_initialized() else 0
        offset = profiler.clock_offset_us()
        mine = self.chrome_events(rank, offset)
        prof = profiler.active()
        if prof is not None:
            mine += [e for e in prof.chrome_events(rank, offset) if e.get("ph") == "X"]
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(mine, parts, dst=0)
        else:
            parts = [mine]
        if rank != 0:
            return None
        assert parts is not None
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        events = [e for part in parts for e in part]
        tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        tmp.replace(out)
        return out
