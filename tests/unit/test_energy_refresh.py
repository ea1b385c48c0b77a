"""A --carbon.series file replaced while the job runs: rank 0's scaling and time shifting follow
the new series within --carbon.refresh seconds of steps; a change that does not parse is said
once and the series read before stays; 0 reads the file once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torsh_distributed.energy import CarbonConfig
from torsh_distributed.energy.carbon import load_series
from torsh_distributed.energy.refresh import SeriesWatch, cap_gap
from torsh_distributed.energy.scale import CarbonScale, ScalePolicy
from torsh_distributed.energy.shift import ShiftPolicy, TimeShift

T0 = 1_900_000_000.0


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _write(path: Path, values: list[int], *, start: float = T0 - 10, slot: float = 2.0) -> None:
    """Written beside and renamed over ``path``, as a forecast job should."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("timestamp,gCO2/kWh\n" + "".join(f"{start + slot * i:.3f},{v}\n" for i, v in enumerate(values)))
    os.replace(tmp, path)


def test_the_scale_driver_follows_a_replaced_series_within_the_refresh_interval(tmp_path: Path):
    path = tmp_path / "s.csv"
    _write(path, [400] * 600 + [100])  # dirty for 20 minutes: 1 worker, checks far apart
    lines: list[str] = []
    watch = SeriesWatch(str(path), lambda: ScalePolicy(load_series(path), 1, 2), lines.append)
    clock = _Clock(T0)
    scale = CarbonScale(ScalePolicy(load_series(path), 1, 2), world_size=1, main=True, start_step=0,
                        max_steps=10_000, launched_at=T0 - 1.0, write=lines.append, clock=clock,
                        broadcast=lambda v: v, refresh=watch, refresh_s=0.5)  # fmt: skip
    flipped_at = None
    for step in range(1, 10_000):
        clock.t += 0.01
        if step == 300:  # the forecast changes: clean from now on
            flipped_at = clock.t
            _write(path, [400] * 5 + [100] * 600, start=clock.t - 10)
        if scale.step_end(step):
            break
    assert scale.stop is not None and scale.stop["world_size"] == 2 and scale.stop["intensity"] == 100
    assert flipped_at is not None and flipped_at <= scale.stop["unix_s"] <= flipped_at + 0.5 + 0.01
    assert watch.reloads == 1 and f"carbon: {path} changed: following the new series" in lines
    # checks at most 0.5 s of steps apart, not one per step
    assert scale.checks <= 300 * 0.01 / 0.5 + 3


def test_without_refresh_the_driver_reads_the_series_once(tmp_path: Path):
    path = tmp_path / "s.csv"
    _write(path, [400] * 600 + [100])
    clock = _Clock(T0)
    scale = CarbonScale(ScalePolicy(load_series(path), 1, 2), world_size=1, main=True, start_step=0,
                        max_steps=2_000, launched_at=T0 - 1.0, clock=clock, broadcast=lambda v: v)  # fmt: skip
    for step in range(1, 2_000):
        clock.t += 0.01
        if step == 300:
            _write(path, [100] * 600, start=clock.t - 10)
        assert not scale.step_end(step)
    assert scale.checks <= 3  # the dirty series holds for 20 minutes


def test_a_replaced_file_that_does_not_parse_is_said_once_and_the_old_series_kept(tmp_path: Path):
    path = tmp_path / "s.csv"
    _write(path, [100, 400, 100])
    lines: list[str] = []
    watch = SeriesWatch(str(path), lambda: load_series(path), lines.append)
    assert watch() is None  # unchanged
    path.write_text("timestamp,gCO2/kWh\n2024-03-01T12:00:00Z,")  # half written
    assert watch() is None and watch() is None
    assert len(lines) == 1 and lines[0].startswith(f"carbon: {path} changed but cannot be read (")
    assert lines[0].endswith("keeping the series read before")
    path.unlink()
    assert watch() is None and len(lines) == 2  # a removed file: said, the old series kept
    _write(path, [100, 100, 100])
    fresh = watch()
    assert fresh is not None and fresh.values == (100, 100, 100) and watch.reloads == 1


def test_the_shift_driver_pauses_in_a_dirty_slot_that_a_refresh_brings(tmp_path: Path):
    path = tmp_path / "s.csv"
    _write(path, [100] * 600)  # clean: no pause ahead, checks far apart
    start = T0 - 10
    clock, lines, slept = _Clock(T0), [], []

    def sleep(s: float) -> None:
        slept.append(s)
        clock.t += s

    shift = TimeShift(lambda t: ShiftPolicy(load_series(path), 300), main=True, start_step=0,
                      max_steps=5_000, write=lines.append, clock=clock, sleep=sleep,
                      broadcast=lambda v: v, refresh=SeriesWatch(str(path), lambda: ShiftPolicy(
                          load_series(path), 300), lines.append), refresh_s=0.5)  # fmt: skip
    for step in range(1, 5_000):
        clock.t += 0.01
        if step == 300:  # a dirty 2 s slot from now: [T0 + 3, T0 + 5)
            dirty_at = clock.t
            slots = int((dirty_at - start) / 2.0)
            _write(path, [100] * slots + [412] + [100] * 600, start=dirty_at - 2.0 * slots)
        shift.step_end(step)
    assert len(shift.pauses) == 1, lines
    pause = shift.pauses[0]
    assert dirty_at <= pause["start"] <= dirty_at + 0.5 + 0.01 and pause["intensity"] == 412
    assert pause["start"] + pause["seconds"] == pytest.approx(dirty_at + 2.0)
    assert shift.checks < 5_000 * 0.01 / 0.5 + 10


def test_cap_gap_and_the_setting():
    assert cap_gap(1000, every_s=0.5, step_s=0.01) == 50
    assert cap_gap(10, every_s=0.5, step_s=0.01) == 10
    assert cap_gap(1000, every_s=0.5, step_s=2.0) == 1
    assert cap_gap(1000, every_s=float("inf"), step_s=0.01) == 1000
    assert cap_gap(1000, every_s=0.0, step_s=0.01) == 1000
    assert CarbonConfig().refresh == 60.0
    with pytest.raises(ValueError, match=r"carbon.refresh must be >= 0 seconds \(0 = read the series once\), got -1"):
        CarbonConfig(refresh=-1)
