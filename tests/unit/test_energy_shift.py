"""Carbon-aware time shifting: the pure policy (pauses only in dirty slots, resumes at the first
clean one, runs through when a pause would miss the deadline, the rule outside the series), the
settings refused before training, and the loop driver on a fake clock (one pause, a checkpoint
before it, few checks)."""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from torsh_distributed.energy import (
    CarbonConfig,
    CpuTimeEstimate,
    EnergyConfig,
    EnergyTracker,
    IntensitySeries,
    grams_of_trace,
)
from torsh_distributed.energy.shift import ShiftPolicy, TimeShift, parse_deadline

T0 = datetime(2024, 3, 1, 12, 0, tzinfo=timezone.utc).timestamp()
VALUES = (100.0, 100.0, 400.0, 450.0, 100.0, 500.0, 100.0, 350.0)  # 2 s slots from T0


def _series(values: tuple[float, ...] = VALUES, *, start: float = T0, slot: float = 2.0) -> IntensitySeries:
    starts = tuple(start + slot * i for i in range(len(values)))
    return IntensitySeries(starts=starts, ends=(*starts[1:], starts[-1] + slot), values=values, detail="test")


def _write(path: Path, values: tuple[float, ...], *, start: float, slot: float = 2.0) -> str:
    path.write_text("timestamp,intensity\n" + "".join(f"{start + slot * i},{v}\n" for i, v in enumerate(values)))
    return str(path)


def test_runs_in_clean_slots_until_the_next_dirty_one():
    policy = ShiftPolicy(_series(), 300)
    d = policy.decide(T0 + 0.5, steps_left=10, step_s=0.1)
    assert d.action == "run" and d.intensity == 100 and d.slot == 0
    assert d.recheck_s == pytest.approx(3.5)  # slot 2 (dirty) starts at T0 + 4
    d = policy.decide(T0 + 9, steps_left=10, step_s=0.1)  # slot 4 clean, slot 5 dirty at +10
    assert d.action == "run" and d.recheck_s == pytest.approx(1.0)
    # at the threshold is clean
    assert ShiftPolicy(_series(), 400).decide(T0 + 4.5, steps_left=1, step_s=0.1).action == "run"


def test_pauses_in_a_dirty_slot_until_the_first_clean_one():
    policy = ShiftPolicy(_series(), 300)
    d = policy.decide(T0 + 4.5, steps_left=10, step_s=0.1)  # slots 2 and 3 dirty, 4 clean
    assert (d.action, d.intensity, d.slot) == ("pause", 400, 2)
    assert d.resume_at == T0 + 8 and d.resume_intensity == 100
    d = policy.decide(T0 + 10.2, steps_left=10, step_s=0.1)
    assert d.action == "pause" and d.resume_at == T0 + 12 and d.intensity == 500


def test_outside_the_series_the_job_runs_and_a_dirty_end_pauses_until_the_series_ends():
    policy = ShiftPolicy(_series(), 300)
    before = policy.decide(T0 - 5, steps_left=10, step_s=0.1)
    assert before.action == "run" and before.intensity is None
    assert before.recheck_s == pytest.approx(9.0)  # the first dirty slot, not the series' start
    after = policy.decide(T0 + 16, steps_left=10, step_s=0.1)
    assert after.action == "run" and math.isinf(after.recheck_s)
    last = policy.decide(T0 + 14.5, steps_left=10, step_s=0.1)  # slot 7 (350) is the last
    assert last.action == "pause" and last.resume_at == T0 + 16 and last.resume_intensity is None
    clean_tail = ShiftPolicy(_series((100.0, 100.0)), 300).decide(T0, steps_left=5, step_s=1)
    assert math.isinf(clean_tail.recheck_s)  # no dirty slot ahead: no more checks


def test_runs_through_a_dirty_slot_when_pausing_would_miss_the_deadline():
    # at T0 + 4.5 a pause lasts until T0 + 8; 10 steps x 0.5 s then end at T0 + 13
    tight = ShiftPolicy(_series(), 300, deadline=T0 + 12)
    d = tight.decide(T0 + 4.5, steps_left=10, step_s=0.5)
    assert d.action == "through" and d.finish_at == T0 + 13 and d.resume_at == T0 + 8
    assert d.recheck_s == pytest.approx(1.0)  # after 1 s more work the pause fits
    assert tight.decide(T0 + 5.5, steps_left=8, step_s=0.5).action == "pause"
    exact = ShiftPolicy(_series(), 300, deadline=T0 + 13)
    assert exact.decide(T0 + 4.5, steps_left=10, step_s=0.5).action == "pause"


def test_check_refuses_an_ended_series_and_a_past_deadline():
    policy = ShiftPolicy(_series(), 300)
    policy.check(T0 + 15.9)
    with pytest.raises(ValueError, match=r"carbon.series test ends at .* before now .*drop --carbon.max-intensity"):
        policy.check(T0 + 16)
    with pytest.raises(ValueError, match=r"carbon.deadline .* is already past"):
        ShiftPolicy(_series(), 300, deadline=T0 + 1).check(T0 + 2)
    with pytest.raises(ValueError, match=r"carbon.max_intensity must be > 0"):
        ShiftPolicy(_series(), 0)


@pytest.mark.parametrize(("text", "expected"), [
    ("30m", ("after", 1800.0)), ("90s", ("after", 90.0)), ("1h30m", ("after", 5400.0)),
    ("2h", ("after", 7200.0)), ("1.5m", ("after", 90.0)),
    ("2024-03-01T12:00:00Z", ("at", T0)), ("2024-03-01 12:00", ("at", T0)),
])
def test_deadline_is_an_iso_time_or_a_duration(text, expected):
    assert parse_deadline(text) == expected


@pytest.mark.parametrize("text", ["45", "soon", "30 minutes", "0s", "m"])
def test_a_deadline_that_is_neither_is_refused(text):
    with pytest.raises(ValueError, match=r"carbon.deadline"):
        parse_deadline(text)


def test_bad_settings_are_refused_when_the_config_is_built(tmp_path: Path):
    now = time.time()
    current = _write(tmp_path / "now.csv", (100, 400, 100), start=now - 1, slot=60)
    ended = _write(tmp_path / "old.csv", (100, 400), start=now - 100, slot=10)
    with pytest.raises(ValueError, match=r"carbon.max_intensity 300 needs --carbon.series FILE"):
        CarbonConfig(max_intensity=300)
    with pytest.raises(ValueError, match=r"carbon.max_intensity 300 needs --carbon.series FILE"):
        CarbonConfig(max_intensity=300, intensity=200)
    with pytest.raises(ValueError, match=r"carbon.deadline '30m' bounds time shifting: give --carbon.max-intensity"):
        CarbonConfig(series=current, deadline="30m")
    CarbonConfig(series=ended)  # without time shifting an old series only prices the energy
    with pytest.raises(ValueError, match=r"neither an ISO 8601 time"):
        CarbonConfig(series=current, max_intensity=300, deadline="tomorrow")
    with pytest.raises(ValueError, match=r"carbon.max_intensity must be >= 0"):
        CarbonConfig(series=current, max_intensity=-1)
    config = CarbonConfig(series=current, max_intensity=300, deadline="10m")
    assert config.shift_policy(start=now).deadline == pytest.approx(now + 600)


def test_an_ended_series_or_past_deadline_stops_a_new_run_but_not_a_resumed_one(tmp_path: Path):
    now = time.time()
    current = _write(tmp_path / "now.csv", (100, 400, 100), start=now - 1, slot=60)
    ended = _write(tmp_path / "old.csv", (100, 400), start=now - 100, slot=10)
    cases = (
        (CarbonConfig(series=ended, max_intensity=300), r"old.csv .* ends at .* before now"),
        (CarbonConfig(series=current, max_intensity=300, deadline="2020-01-01T00:00:00Z"),
         r"carbon.deadline .* is already past"),
    )
    for config, match in cases:
        with pytest.raises(ValueError, match=match):  # a new run: before its first step
            TimeShift(lambda start, c=config: c.shift_policy(start=start), main=True, start_step=0,
                      max_steps=10, broadcast=lambda v: v)
        lines: list[str] = []
        # a restarted attempt resuming at step 4 (a checkpoint after the series ended): runs on
        shift = TimeShift(lambda start, c=config: c.shift_policy(start=start), main=True, start_step=4,
                          max_steps=10, broadcast=lambda v: v, write=lines.append)
        assert any("nothing left to do on this resumed run" in line for line in lines), lines
        for step in range(5, 11):
            shift.step_end(step, save=lambda: pytest.fail("no checkpoint: nothing to pause for"))
        assert shift.pauses == []


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def _loop(shift: TimeShift, clock: _Clock, *, steps: int, step_s: float, saves: list[int]) -> None:
    for step in range(steps):
        clock.t += step_s
        shift.step_end(step + 1, save=lambda s=step + 1: saves.append(s))


def test_the_driver_pauses_once_in_the_dirty_slot_after_a_checkpoint_with_few_checks():
    values = (100, 100, 100, 100, 412, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100)
    clock, lines, saves = _Clock(T0), [], []
    shift = TimeShift(lambda start: ShiftPolicy(_series(values), 300, deadline=start + 60),
                      main=True, start_step=0, max_steps=200, write=lines.append,
                      clock=clock, sleep=clock.sleep)
    _loop(shift, clock, steps=200, step_s=0.1, saves=saves)
    summary = shift.summary()
    assert len(summary["pauses"]) == 1
    pause = summary["pauses"][0]
    assert T0 + 8 <= pause["start"] < T0 + 8.2  # found within one step of the slot's start
    assert pause["start"] + pause["seconds"] == pytest.approx(T0 + 10)  # resumed at the next slot
    assert pause["intensity"] == 412 and saves == [pause["step"]]
    assert summary["paused_s"] == pytest.approx(pause["seconds"])
    assert summary["met_deadline"] is True and summary["deadline_unix_s"] == T0 + 60
    assert summary["ran_through"] == []
    assert summary["shift_checks"] < 25  # of 200 steps: one integer comparison on the others
    assert lines[0].startswith("carbon: time shifting: pausing while the intensity is above 300 g/kWh")
    assert [line for line in lines if "paused" in line] == [
        f"carbon: intensity 412 g/kWh > 300 at step {pause['step']}: paused "
        f"{T0 + 10 - pause['start']:.1f} s until 2024-03-01 12:00:10 UTC (next slot 100 g/kWh)"
    ]


def test_the_driver_runs_through_when_the_deadline_is_near_and_says_so_once():
    values = (100, 100, 100, 100, 412, 100, 100)
    clock, lines, saves = _Clock(T0), [], []
    shift = TimeShift(lambda start: ShiftPolicy(_series(values), 300, deadline=start + 9.5),
                      main=True, start_step=0, max_steps=90, write=lines.append,
                      clock=clock, sleep=clock.sleep)
    _loop(shift, clock, steps=90, step_s=0.1, saves=saves)  # 9 s of work: no room for 2 s idle
    summary = shift.summary()
    assert summary["pauses"] == [] and saves == [] and clock.slept == []
    assert len(summary["ran_through"]) == 1 and summary["ran_through"][0]["intensity"] == 412
    said = [line for line in lines if "not pausing" in line]
    assert len(said) == 1 and "after the deadline" in said[0] and "steps left x" in said[0]
    assert summary["met_deadline"] is True


def test_off_costs_nothing_and_an_error_on_rank_0_is_raised_on_every_rank():
    off = TimeShift(None, main=True, start_step=0, max_steps=10, broadcast=lambda v: pytest.fail("collective"))
    off.step_end(1)
    assert off.summary() == {}
    with pytest.raises(ValueError, match=r"ends at .* before now"):
        TimeShift(lambda start: ShiftPolicy(_series(), 300), main=True, start_step=0, max_steps=10,
                  broadcast=lambda v: v, clock=lambda: T0 + 100)
    with pytest.raises(ValueError, match=r"rank 0 refused the time-shifting settings"):
        TimeShift(lambda start: pytest.fail("rank 0 only"), main=False, start_step=0, max_steps=10,
                  broadcast=lambda v: [1.0, math.nan, 0.0])


def test_a_follower_rank_pauses_as_rank_0_says():
    clock, saves = _Clock(T0), []
    told = iter([[0.0, T0 + 60, 300.0], [0.0, 0.0, 5.0, math.nan, T0], [1.0, 1.5, 6.0, 412.0, T0 + 1],
                 [0.0, 0.0, 10.0, 100.0, T0 + 3]])
    shift = TimeShift(lambda start: pytest.fail("rank 0 only"), main=False, start_step=0, max_steps=10,
                      broadcast=lambda v: next(told), clock=clock, sleep=clock.sleep)
    _loop(shift, clock, steps=10, step_s=0.1, saves=saves)
    summary = shift.summary()
    assert summary["shift_checks"] == 3 and saves == [5]  # steps 1, 5 and 6, as rank 0 named them
    # its own clock's start and seconds (rank 0's clock decided the length)
    assert summary["pauses"] == [{"step": 5, "start": pytest.approx(T0 + 0.5), "seconds": pytest.approx(1.5), "intensity": 412.0}]
    assert summary["deadline_unix_s"] == T0 + 60 and summary["max_intensity_g_per_kwh"] == 300


def test_the_cli_refuses_an_ended_series_in_one_line_before_any_rank_starts(tmp_path: Path, capfd):
    from torsh_distributed.cli.main import main

    ended = _write(tmp_path / "old.csv", (100, 400), start=time.time() - 100, slot=10)
    assert main(["train", "--preset", "tiny", "--progress", "false", "--nproc-per-node", "2",
                 "--carbon.series", ended, "--carbon.max-intensity", "300",
                 "--checkpoint.dir", str(tmp_path / "ckpt")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "old.csv" in err[0] and "before now" in err[0], err
    assert not (tmp_path / "ckpt").exists()


def test_energy_before_a_pause_is_not_charged_to_the_pause(tmp_path: Path):
    values = (100, 100, 100, 100, 412, 100, 100, 100)  # the dirty slot: T0 + 8 to T0 + 10
    clock, cpu = _Clock(T0), _Clock(0.0)
    series = _series(values)
    carbon = CarbonConfig(series=_write(tmp_path / "s.csv", values, start=T0))
    tracker = EnergyTracker(EnergyConfig(interval=3600.0), carbon, meter=CpuTimeEstimate(watts_per_core=10.0, cpu_seconds=cpu),
                            clock=clock)
    tracker.start()
    shift = TimeShift(lambda start: ShiftPolicy(series, 300), main=True, start_step=0, max_steps=120,
                      write=lambda line: None, clock=clock, sleep=clock.sleep)
    for step in range(120):  # 0.1 s steps of 1 J each; the pause idles (no CPU time)
        clock.t += 0.1
        cpu.t += 0.1
        tracker.step_end()
        shift.step_end(step + 1, mark=tracker.reading)
    [pause] = shift.pauses
    tracker.row()
    # readings at the pause's start and end (the interval of an hour takes none in between)
    assert tracker.times[1:3] == [pause["start"], pause["start"] + pause["seconds"]]
    start, end = tracker.times[1], tracker.times[2]
    before = tracker.joules[1]
    expected, _ = grams_of_trace([T0, start, end, tracker.times[-1]], [0.0, before, before, 120.0], series)
    assert tracker.grams == pytest.approx(expected)
    # spread over the pause, the same joules would cost more: the test can tell them apart
    spread, _ = grams_of_trace([T0, end, tracker.times[-1]], [0.0, before, 120.0], series)
    assert spread > 1.2 * expected
