"""Carbon-aware scaling: the pure policy (MAX workers in the cleanest slot, MIN in the dirtiest,
linear between, MAX outside the series; how long a target holds), the loop driver on a fake
clock (one stop at the dirty slot after a checkpoint, none when a restart would not pay, a
follower obeys rank 0), the job's summary over segments, the settings refused before launch, and
the launcher's segment loop with a fake launch."""

from __future__ import annotations

import importlib
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from torsh_distributed.elastic import resize
from torsh_distributed.elastic.launch import LaunchOptions
from torsh_distributed.energy import CarbonConfig, IntensitySeries
from torsh_distributed.energy.scale import CarbonScale, ScalePolicy, scaling_summary
from torsh_distributed.engine.config import EngineConfig

T0 = datetime(2024, 3, 1, 12, 0, tzinfo=timezone.utc).timestamp()


def _series(values: tuple[float, ...], *, start: float = T0, slot: float = 2.0) -> IntensitySeries:
    starts = tuple(start + slot * i for i in range(len(values)))
    return IntensitySeries(starts=starts, ends=(*starts[1:], starts[-1] + slot), values=values, detail="test")


def test_the_cleanest_slot_gets_max_the_dirtiest_min_and_linear_in_between():
    policy = ScalePolicy(_series((100, 500, 300, 233, 367)), 1, 4)
    assert [policy.size_for(v) for v in (100, 500, 300, 233, 367)] == [4, 1, 2, 3, 2]
    assert policy.size_for(None) == 4  # no data: as a carbon-agnostic job runs
    only = ScalePolicy(_series((100, 500, 300, 233, 367)), 1, 4, sizes=(1, 2, 4))  # 3 cannot run
    assert [only.size_for(v) for v in (100, 500, 300, 233, 367)] == [4, 1, 2, 2, 2]  # rounds down
    with pytest.raises(ValueError, match=r"sizes \[2, 4\] must run from 1 to 4"):
        ScalePolicy(_series((100, 200)), 1, 4, sizes=(2, 4))
    assert ScalePolicy(_series((200, 200)), 1, 3).size_for(200) == 3  # a flat series never scales
    with pytest.raises(ValueError, match=r"1 <= MIN < MAX workers, got 2:2"):
        ScalePolicy(_series((100, 200)), 2, 2)


def test_a_target_holds_until_the_size_changes_and_outside_the_series_it_is_max():
    policy = ScalePolicy(_series((100, 100, 400, 400, 100, 400)), 1, 2)
    t = policy.target(T0 + 0.5)
    assert (t.world_size, t.intensity, t.slot) == (2, 100, 0) and t.holds_s == pytest.approx(3.5)
    t = policy.target(T0 + 5)  # slots 2-3 dirty: 1 worker until slot 4 at T0 + 8
    assert (t.world_size, t.intensity) == (1, 400) and t.holds_s == pytest.approx(3.0)
    before = policy.target(T0 - 3)
    assert (before.world_size, before.intensity, before.slot) == (2, None, -1)
    assert before.holds_s == pytest.approx(7.0)  # until the first dirty slot, not the series' start
    last = policy.target(T0 + 11)  # the last slot is dirty: MAX again when the series ends
    assert last.world_size == 1 and last.holds_s == pytest.approx(1.0)
    after = policy.target(T0 + 12)
    assert after.world_size == 2 and math.isinf(after.holds_s)
    assert math.isinf(ScalePolicy(_series((400, 100)), 1, 2).target(T0 + 3).holds_s)


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _loop(scale: CarbonScale, clock: _Clock, *, steps: int, step_s: float, saves: list[int]) -> int:
    """Steps until the driver stops the segment; the step it stopped at (or ``steps``)."""
    for step in range(steps):
        clock.t += step_s
        if scale.step_end(step + 1, save=lambda s=step + 1: saves.append(s)):
            return step + 1
    return steps


def test_the_driver_stops_at_the_first_step_of_a_dirty_slot_after_a_checkpoint_with_few_checks():
    values = (100, 100, 400, 400, 400, 100, 100)
    clock, lines, saves = _Clock(T0), [], []
    scale = CarbonScale(ScalePolicy(_series(values), 1, 2), world_size=2, main=True, start_step=0,
                        max_steps=200, launched_at=T0 - 1.0, write=lines.append, clock=clock,
                        broadcast=lambda v: v)
    stopped = _loop(scale, clock, steps=200, step_s=0.05, saves=saves)
    assert stopped < 200 and saves == [stopped]
    assert scale.stop is not None and scale.stop["world_size"] == 1 and scale.stop["intensity"] == 400
    assert T0 + 4 <= scale.stop["unix_s"] < T0 + 4.05 + 1e-9  # within one step of the slot's start
    assert scale.restart_s == pytest.approx(1.0)  # launch to the first step's start
    assert scale.checks < 15  # of 80 steps: one integer comparison on the others
    assert lines == [f"carbon: intensity 400 g/kWh at step {stopped}: world size 2 -> 1 (checkpoint "
                     "and restart; the new size holds 6.0 s)"]


def test_no_change_when_the_new_size_holds_less_than_a_restart_and_it_is_said_once():
    values = (400, 400, 100, 400, 400, 400, 400)  # a 2 s clean slot; restarts take 3 s
    clock, lines, saves = _Clock(T0), [], []
    scale = CarbonScale(ScalePolicy(_series(values), 1, 2), world_size=1, main=True, start_step=0,
                        max_steps=260, launched_at=T0 - 3.0, write=lines.append, clock=clock,
                        broadcast=lambda v: v)
    assert _loop(scale, clock, steps=260, step_s=0.05, saves=saves) == 260  # ends in the series
    assert scale.stop is None and saves == []
    assert len(scale.kept) == 1 and scale.kept[0]["world_size"] == 2
    assert len(lines) == 1 and "asks for world size 2: staying at 1: the new size holds" in lines[0]
    assert "less than a restart (3.0 s)" in lines[0]


def test_no_change_when_the_work_left_is_shorter_than_a_restart():
    clock, lines = _Clock(T0 + 3.9), []
    scale = CarbonScale(ScalePolicy(_series((100, 100, 400, 400, 400)), 1, 2), world_size=2, main=True,
                        start_step=0, max_steps=10, launched_at=T0 + 1.0, write=lines.append,
                        clock=clock, broadcast=lambda v: v)
    assert _loop(scale, clock, steps=10, step_s=0.05, saves=[]) == 10  # 0.5 s of work, 2.85 s restart
    assert scale.stop is None and "the work left takes" in lines[0]


def test_off_costs_nothing_and_a_follower_stops_where_rank_0_says():
    off = CarbonScale(None, world_size=2, main=True, start_step=0, max_steps=10,
                      broadcast=lambda v: pytest.fail("collective"))
    assert not off.step_end(1) and off.summary() == {}
    told = iter([[0.0, 4.0, 100.0, 2.0, T0], [1.0, 4.0, 400.0, 1.0, T0 + 1]])
    clock, saves = _Clock(T0), []
    follower = CarbonScale(ScalePolicy(_series((100, 400)), 1, 2), world_size=2, main=False,
                           start_step=0, max_steps=10, clock=clock, broadcast=lambda v: next(told))
    assert _loop(follower, clock, steps=10, step_s=0.1, saves=saves) == 4  # checks at 1 and 4
    assert saves == [4] and follower.stop == {"step": 4, "unix_s": T0 + 1, "intensity": 400.0, "world_size": 1}
    assert follower.checks == 2


def _segment(index: int, size: int, start: int, end: int, *, stop: bool) -> dict[str, Any]:
    return {"index": index, "world_size": size, "launched_unix_s": T0 + 10 * index, "intensity": 100.0 * size,
            "start_step": start, "end_step": end, "first_step_unix_s": T0 + 10 * index + 2,
            "ended_unix_s": T0 + 10 * index + 8, "joules": 1.5 * (index + 1), "grams": 0.25,
            "stop": {"step": end} if stop else None}


def test_the_summary_lists_each_decision_and_totals_the_segments():
    segments = [_segment(0, 2, 0, 40, stop=True), _segment(1, 1, 40, 55, stop=True), _segment(2, 2, 55, 100, stop=False)]
    got = scaling_summary(segments, sizes=[1, 2])
    assert got["world_sizes"] == [2, 1, 2] and got["restarts"] == 2 and got["steps"] == 100
    assert got["decisions"][1] == {"unix_s": T0 + 10, "step": 40, "intensity": 100.0, "world_size": 1}
    assert got["joules"] == pytest.approx(9.0) and got["grams"] == pytest.approx(0.75)
    assert got["wall_s"] == pytest.approx(28.0)
    segments[1]["grams"] = None  # a segment with metering off: no total rather than a wrong one
    assert scaling_summary(segments, sizes=[1, 2])["grams"] is None


def _csv(path: Path, values: tuple[float, ...], *, start: float, slot: float = 2.0) -> str:
    path.write_text("timestamp,intensity\n" + "".join(f"{start + slot * i},{v}\n" for i, v in enumerate(values)))
    return str(path)


def test_bad_settings_are_refused_when_the_config_is_built(tmp_path: Path):
    now = datetime.now(tz=timezone.utc).timestamp()
    series = _csv(tmp_path / "s.csv", (100, 400, 100), start=now)
    with pytest.raises(ValueError, match=r"^carbon.scale needs --carbon.series FILE"):
        CarbonConfig(scale=True, intensity=300)
    with pytest.raises(ValueError, match=r"^carbon.scale with carbon.max_intensity is not built"):
        CarbonConfig(scale=True, series=series, max_intensity=300)
    # a series that has ended is refused by the launcher (a later segment may start after its end)
    old = CarbonConfig(scale=True, series=_csv(tmp_path / "old.csv", (100, 400), start=now - 100))
    with pytest.raises(ValueError, match=r"ends at .* before now .*drop --carbon.scale"):
        old.scale_policy([1, 2]).check(now)
    with pytest.raises(ValueError, match=r"^carbon.scale needs --checkpoint.dir DIR"):
        EngineConfig(carbon=CarbonConfig(scale=True, series=series))
    assert CarbonConfig(scale=True, series=series).scale_policy([1, 3]).sizes == (1, 3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc-per-node", "1:2"], r"--nproc-per-node 1:2 is a range for carbon-aware scaling: add --carbon.scale"),
        (["--nproc-per-node", "2", "--carbon.scale"], r"--carbon.scale needs the range to scale between: --nproc-per-node MIN:MAX .* or --nnodes MIN:MAX"),
        (["--nnodes", "2:1", "--carbon.scale"], r"--nnodes MIN:MAX must satisfy 1 <= MIN < MAX, got '2:1'"),
        (["--nnodes", "1:2", "--carbon.scale", "--rdzv-endpoint", "127.0.0.1:29400"], r"launches each segment itself .*drop --rdzv-endpoint"),
        (["--nnodes", "1:3", "--nproc-per-node", "2", "--carbon.scale", "--batch-size", "8"], r"--nnodes 1:3 at 6 workers: batch_size 8 .*not divisible"),
        (["--nproc-per-node", "2:1", "--carbon.scale"], r"must satisfy 1 <= MIN < MAX, got '2:1'"),
        (["--nproc-per-node", "1:x", "--carbon.scale"], r"must be two integers, got '1:x'"),
        (["--nproc-per-node", "1:2", "--carbon.scale", "--nnodes", "2", "--master-addr", "127.0.0.1"],
         r"scales the workers of one node: for several nodes scale whole nodes \(--nnodes MIN:MAX\), not with --nnodes 2"),
        (["--nproc-per-node", "2:3", "--carbon.scale", "--batch-size", "8"], r"2:3 at 3 workers: batch_size 8 .*not divisible"),
        (["--nproc-per-node", "1:2", "--carbon.scale", "ENDED"], r"ends at .* before now .*drop --carbon.scale"),
    ],
)
def test_the_launcher_refuses_a_bad_range_in_one_line_before_any_rank_starts(tmp_path, capfd, flags, message):
    from torsh_distributed.cli.main import main

    start = datetime.now(tz=timezone.utc).timestamp() - (2000 if "ENDED" in flags else 0)
    flags = [f for f in flags if f != "ENDED"]
    series = _csv(tmp_path / "s.csv", (100, 400, 100), start=start, slot=600)
    scale = ["--carbon.series", series, "--checkpoint.dir", str(tmp_path / "ckpt")] if "--carbon.scale" in flags else []
    assert main(["train", "--preset", "tiny", "--progress", "false", *scale, *flags]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("torsh-dist train: error: ")
    assert __import__("re").search(message, err[0]), err[0]


def test_the_segment_loop_relaunches_at_the_size_chosen_now_until_a_segment_asks_for_none(monkeypatch):
    launch_module = importlib.import_module("torsh_distributed.elastic.launch")

    launched: list[tuple[int, dict[str, Any]]] = []
    plan = iter([True, True, False])  # segments 0 and 1 ask for another size, 2 ends the job

    def fake_launch(options: LaunchOptions, *, module: str, args: Any) -> int:
        seg = resize.current_segment(options.env)
        assert seg is not None and module == "m" and list(args) == ["--x"]
        launched.append((options.nproc_per_node, seg.why))
        resize.append_record(seg.log, {"index": seg.index, "stop": {"step": 1} if next(plan) else None})
        return 0

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    sizes = iter([2, 1, 2])
    lines: list[str] = []
    code = resize.launch_resizing(
        LaunchOptions(nproc_per_node=2), choose=lambda now: (next(sizes), {"intensity": 1.0, "text": "why"}),
        sizes=[1, 2], module="m", args=["--x"], write=lines.append,
    )
    assert code == 0 and [n for n, _ in launched] == [2, 1, 2]
    assert lines == ["torsh-dist: segment 0: 2 worker(s) (why)", "torsh-dist: segment 1: 1 worker(s) (why)",
                     "torsh-dist: segment 2: 2 worker(s) (why)"]


def test_the_segment_loop_returns_a_failed_segments_code_and_refuses_several_nodes(monkeypatch, tmp_path):
    launch_module = importlib.import_module("torsh_distributed.elastic.launch")

    monkeypatch.setattr(launch_module, "launch", lambda options, **kw: 3)
    assert resize.launch_resizing(LaunchOptions(), choose=lambda now: (1, {}), sizes=[1, 2], module="m") == 3
    with pytest.raises(ValueError, match=r"resizing runs on one node, got nnodes='1:2'"):
        resize.launch_resizing(LaunchOptions(nnodes="1:2", rdzv_endpoint="127.0.0.1:1"),
                               choose=lambda now: (1, {}), sizes=[1, 2], module="m")
    with pytest.raises(ValueError, match=r"choose gave world size 3, not one of \[1, 2, 4\]"):
        resize.launch_resizing(LaunchOptions(), choose=lambda now: (3, {}), sizes=[4, 1, 2], module="m")
    log = tmp_path / "log.jsonl"
    resize.append_record(log, {"index": 0})
    resize.append_record(log, {"index": 1, "stop": None})
    assert resize.read_records(log) == [{"index": 0}, {"index": 1, "stop": None}]
    assert resize.read_records(tmp_path / "none.jsonl") == []
    env = {resize.SEGMENT_ENV: json.dumps({"index": 1, "world_size": 2, "sizes": [1, 2, 4],
                                           "launched_unix_s": T0, "why": {}, "log": str(log)})}
    seg = resize.current_segment(env)
    assert seg == resize.Segment(1, 2, [1, 2, 4], T0, {}, str(log)) and (seg.min_size, seg.max_size) == (1, 4)
    assert resize.current_segment({}) is None


def test_the_launcher_skips_a_size_the_batch_cannot_split_into_and_says_so(tmp_path, capfd, monkeypatch):
    from torsh_distributed.cli.main import main

    got: dict[str, Any] = {}

    def fake(options: LaunchOptions, *, choose: Any, sizes: list[int], module: str, args: Any) -> int:
        got.update(sizes=sizes, first=choose(datetime.now(tz=timezone.utc).timestamp()))
        return 0

    monkeypatch.setattr(resize, "launch_resizing", fake)
    series = _csv(tmp_path / "s.csv", (400, 100), start=datetime.now(tz=timezone.utc).timestamp() - 1, slot=600)
    assert main(["train", "--preset", "tiny", "--nproc-per-node", "1:4", "--batch-size", "8", "--carbon.scale",
                 "--carbon.series", series, "--checkpoint.dir", str(tmp_path / "ckpt")]) == 0
    out = capfd.readouterr().out
    assert "torsh-dist: carbon scaling skips world size 3 (batch_size 8 (global) is not divisible" in out
    assert got["sizes"] == [1, 2, 4] and got["first"][0] == 1  # the dirty slot: 1 worker
    assert got["first"][1]["intensity"] == 400 and got["first"][1]["text"].startswith("carbon: intensity 400 g/kWh at ")


def test_the_energy_report_lists_the_segments_and_the_pauses():
    from torsh_distributed.energy.report import format_report

    segments = [_segment(0, 2, 0, 40, stop=True), _segment(1, 1, 40, 100, stop=False)]
    energy = {"joules": 4.5, "source": "estimated", "meter": "estimate", "steps": 60, "seconds": 8.0,
              "average_power_w": 0.5, "joules_per_step": 0.075, "ranks": []}
    carbon = {"grams": 0.25, "intensity_source": "series", "intensity_g_per_kwh": 100.0,
              "scaling": scaling_summary(segments, sizes=[1, 2]),
              "pauses": [{"step": 7, "start": T0, "seconds": 2.0, "intensity": 412.0}], "paused_s": 2.0,
              "max_intensity_g_per_kwh": 300.0, "deadline": None}
    text = format_report({"energy": energy, "carbon": carbon})
    assert "  shifting: 1 pause(s), 2.0 s paused while above 300 g/kWh" in text
    assert "    step 7: paused 2.0 s from 2024-03-01 12:00:00 UTC at 412 g/kWh" in text
    assert ("  scaling:  1 to 2 workers, 1 restart(s); all segments: 4.5 J, 0.5 g CO2e, 100 steps in 18.0 s "
            "(the figures above are the last segment's)") in text
    rows = [line.split() for line in text.splitlines() if line.startswith("          ")]
    assert ["0", "2024-03-01", "12:00:00", "UTC", "0-40", "2", "200", "1.5", "0.25"] in rows
    assert ["1", "2024-03-01", "12:00:10", "UTC", "40-100", "1", "100", "3", "0.25"] in rows
