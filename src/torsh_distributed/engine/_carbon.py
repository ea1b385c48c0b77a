"""Carbon-aware time shifting and scaling of one run (private; see docs/energy.md).

:class:`CarbonControl` builds both drivers from the ``carbon`` section, is called once per step
(:meth:`CarbonControl.step_end`: a pause, or the end of a scaling segment after a checkpoint)
and adds their figures to the summary's ``carbon`` block. Under scaling it also writes this
segment's record into the launcher's segment log, which is how the launcher learns that the job
asks for another world size, and how the last segment reports every segment's figures.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torsh_distributed.elastic.resize import Segment, append_record, current_segment, read_records
from torsh_distributed.energy.config import CarbonConfig
from torsh_distributed.energy.refresh import SeriesWatch
from torsh_distributed.energy.scale import CarbonScale, scaling_summary
from torsh_distributed.energy.shift import TimeShift
from torsh_distributed.engine.config import EngineConfig

__all__ = ["CarbonControl"]

P = TypeVar("P")


def _watch(carbon: CarbonConfig, build: Callable[[], P], write: Callable[[str], None]) -> SeriesWatch[P] | None:
    """Rank 0's watch of the series file (``None`` with ``--carbon.refresh 0``)."""
    return SeriesWatch(carbon.series, build, write) if carbon.refresh > 0 and carbon.series else None


class CarbonControl:
    """Time shifting (``--carbon.max-intensity``) and scaling (``--carbon.scale``) of a run.

    Args:
        cfg: The run's config (its ``carbon`` section and ``max_steps``).
        main: Whether this is rank 0 (it decides, prints and writes the segment log).
        world_size: The running world size.
        start_step: The step this process starts at.
        write: Prints a line on rank 0.
        device: Where the decision broadcasts' tensors live.
        save: ``save(step)`` checkpoints now (collective): before a pause or a change of size.
        reading: Reads the energy meter now: called as a pause starts and as it ends.
    """

    def __init__(
        self,
        cfg: EngineConfig,
        *,
        main: bool,
        world_size: int,
        start_step: int,
        write: Callable[[str], None],
        device: Any,
        save: Callable[[int], None],
        reading: Callable[[], None] | None = None,
    ) -> None:
        carbon = cfg.carbon
        self.shift = TimeShift(
            (lambda start: carbon.shift_policy(start=start)) if carbon.max_intensity else None,
            main=main, start_step=start_step, max_steps=cfg.max_steps, write=write, device=device,
            # the same start as the first policy: a duration deadline counts from it
            refresh=_watch(carbon, lambda: carbon.shift_policy(start=self.shift.started), write)
            if main and carbon.max_intensity else None,
            refresh_s=carbon.refresh,
        )
        self.segment: Segment | None = current_segment() if carbon.scale else None
        if carbon.scale and self.segment is None and main:
            warnings.warn(
                "carbon.scale is ignored: changing the world size needs `torsh-dist train "
                "--nproc-per-node MIN:MAX` (or --nnodes MIN:MAX), which restarts the workers (this job was launched "
                "another way); it runs at its launch size",
                stacklevel=2,
            )
        seg = self.segment
        self.scale = CarbonScale(
            carbon.scale_policy(seg.sizes) if seg is not None else None,
            world_size=world_size, main=main, start_step=start_step, max_steps=cfg.max_steps,
            launched_at=seg.launched_unix_s if seg is not None else None, write=write, device=device,
            refresh=_watch(carbon, lambda: carbon.scale_policy(seg.sizes), write)
            if main and seg is not None else None,
            refresh_s=carbon.refresh,
        )
        self.main, self.start_step, self._save, self._reading = main, start_step, save, reading

    @property
    def stopped(self) -> bool:
        """True once this scaling segment has ended for a new world size."""
        return self.scale.stop is not None

    def step_end(self, step: int) -> None:
        """After ``step`` steps (every rank): pause, or end the segment (see :attr:`stopped`)."""
        self.shift.step_end(step, save=lambda: self._save(step), mark=self._reading)
        self.scale.step_end(step, save=lambda: self._save(step))

    def summary(self, carbon: dict[str, Any], *, energy: dict[str, Any], end_step: int,
                first_step_unix_s: float) -> dict[str, Any]:
        """The ``carbon`` block with time shifting's fields and, under scaling, ``scaling``
        (every segment so far; see :func:`~torsh_distributed.energy.scale.scaling_summary`).
        Rank 0 appends this segment's record to the launcher's log."""
        out = {**carbon, **self.shift.summary()}
        seg = self.segment
        if seg is None:
            return out
        stop = self.scale.stop
        record = {
            "index": seg.index,
            "world_size": seg.world_size,
            "launched_unix_s": seg.launched_unix_s,
            "intensity": seg.why.get("intensity"),
            "start_step": self.start_step,
            "end_step": end_step,
            "first_step_unix_s": first_step_unix_s,
            "ended_unix_s": stop["unix_s"] if stop else time.time(),
            "joules": energy.get("joules"),
            "grams": carbon.get("grams"),
            **self.scale.summary(),
        }
        earlier = [r for r in read_records(seg.log) if r.get("index", -1) < seg.index]
        if self.main:
            append_record(seg.log, record)
        out["scaling"] = scaling_summary([*earlier, record], sizes=seg.sizes)
        return out
