"""The tracker's per-rank figures and the job's totals (one count per counter, measured never
added to estimated), the config sections, `torsh-dist energy report`, and the package's layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torsh_distributed.energy import (
    CarbonConfig,
    ConstantIntensity,
    CpuTimeEstimate,
    EnergyConfig,
    EnergyTracker,
    combine,
    grams_of_trace,
)


class _Clock:
    """A settable clock (the tracker's wall clock and the estimate's CPU seconds)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_tracker_reads_once_per_interval_and_reports_per_step_and_token():
    wall, cpu = _Clock(1000.0), _Clock(0.0)
    meter = CpuTimeEstimate(watts_per_core=10.0, cpu_seconds=cpu)
    tracker = EnergyTracker(EnergyConfig(interval=3600.0), CarbonConfig(intensity=200.0), rank=0,
                            samples_per_step=4, tokens_per_step=256, meter=meter, clock=wall)
    tracker.start()
    for _ in range(5):
        wall.t += 1.0
        cpu.t += 0.5  # 5 J per step
        tracker.step_end()
    assert len(tracker.times) == 1, "an interval of an hour: no reading during the steps"
    energy, carbon = tracker.finish(gather=lambda row: [row])
    assert energy["joules"] == pytest.approx(25.0) and energy["steps"] == 5
    assert energy["joules_per_step"] == pytest.approx(5.0)
    assert energy["joules_per_sample"] == pytest.approx(25.0 / 20)
    assert energy["joules_per_token"] == pytest.approx(25.0 / 1280)
    assert energy["average_power_w"] == pytest.approx(5.0)
    assert energy["source"] == "estimated" and energy["meter"] == "estimate"
    assert carbon["grams"] == pytest.approx(25.0 / 3.6e6 * 200) and carbon["intensity_source"] == "constant"
    assert energy["ranks"][0]["trace"] == [[0.0, 0.0], [5.0, 25.0]]


def test_tracker_samples_every_step_with_a_short_interval_and_is_off_when_asked():
    wall, cpu = _Clock(0.0), _Clock(0.0)
    tracker = EnergyTracker(EnergyConfig(interval=1e-9), CarbonConfig(intensity=1.0),
                            meter=CpuTimeEstimate(cpu_seconds=cpu), clock=wall)
    tracker.start()
    for _ in range(3):
        wall.t += 1.0
        cpu.t += 1.0
        tracker.step_end()
    assert len(tracker.times) == 4
    off = EnergyTracker(EnergyConfig(meter="off"), CarbonConfig())
    off.start()
    off.step_end()
    assert off.finish() == ({}, {}) and off.steps == 0


def _row(rank: int, *, source: str = "measured", scope: str = "host", key: str = "nodeA",
         joules: float = 100.0, tokens: int = 0) -> dict:
    return {"rank": rank, "meter": "rapl" if scope == "host" else "estimate", "source": source,
            "scope": scope, "scope_key": key, "detail": "", "why": "", "joules": joules,
            "seconds": 10.0, "average_power_w": joules / 10, "steps": 4, "samples": 8,
            "tokens": tokens, "grams": joules / 3.6e6 * 100, "seconds_outside_series": 0.0,
            "trace": [[0, 0], [10, joules]]}


def test_a_host_counter_counts_once_and_estimates_are_never_added_to_measurements():
    intensity = ConstantIntensity(100.0)
    energy, carbon = combine([_row(0), _row(1), _row(2, key="nodeB", joules=50.0)], intensity)
    assert energy["joules"] == pytest.approx(150.0) and energy["counters"] == 2
    assert carbon["grams"] == pytest.approx(150 / 3.6e6 * 100)
    assert "joules_per_token" not in energy
    mixed = [_row(0), _row(1, source="estimated", scope="process", key="rank1", joules=7.0)]
    energy, _ = combine(mixed, intensity)
    assert energy["joules"] == pytest.approx(100.0) and energy["source"] == "measured"
    assert energy["excluded"]["ranks"] == [1] and energy["excluded"]["estimated_joules"] == 7.0


def test_energy_config_validation():
    with pytest.raises(ValueError, match="energy.meter must be one of auto, rapl, nvml, estimate, off, got 'gpu'"):
        EnergyConfig(meter="gpu")
    with pytest.raises(ValueError, match="energy.interval must be > 0 seconds"):
        EnergyConfig(interval=0)
    with pytest.raises(ValueError, match="energy.watts_per_core must be > 0 W"):
        EnergyConfig(watts_per_core=-1)
    with pytest.raises(ValueError, match="energy.meter rapl: unavailable on rank 3: .* does not exist"):
        EnergyTracker(EnergyConfig(meter="rapl", powercap_root="/nonexistent/powercap"),
                      CarbonConfig(), rank=3)


def test_energy_report_prints_the_job_and_every_rank_and_plots(tmp_path: Path, capsys):
    from torsh_distributed.cli.main import main

    energy, carbon = combine([_row(0, tokens=512), _row(1, tokens=512), _row(2, key="nodeB", tokens=512)],
                             ConstantIntensity(100.0))
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 4, "energy": energy, "carbon": carbon}))
    (run / "other.json").write_text(json.dumps({"not": "a summary"}))
    png = tmp_path / "energy.png"
    assert main(["energy", "report", str(run), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "energy:  200 J (measured, meter rapl) over 4 steps" in out
    assert "per token 0.1302 J" in out and "carbon:  0.005556 g CO2e at 100 g/kWh (constant" in out
    assert len([line for line in out.splitlines() if " rapl  measured" in line]) == 3
    assert "the job counts each once" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["energy", "report", str(run / "other.json")]) == 2
    assert "not a run summary with an energy block" in capsys.readouterr().err
    assert main(["energy", "report", str(tmp_path / "none")]) == 2


def test_the_energy_package_imports_no_upper_layer():
    import ast

    root = Path(__file__).resolve().parents[2] / "src" / "torsh_distributed" / "energy"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[1:2] not in (["engine"], ["train"], ["cli"]), path


def test_losses_are_bit_identical_with_metering_on_or_off(capsys, tmp_path: Path):
    from torsh_distributed.checkpoint.config import CheckpointConfig
    from torsh_distributed.energy.config import EnergyConfig as Energy
    from torsh_distributed.train import preset
    from torsh_distributed.train.trainer import train

    def run(meter: str):
        config = preset("tiny")
        config.max_steps, config.batch_size, config.progress, config.threads = 3, 8, False, 1
        config.data.max_bytes, config.eval_batches, config.eval_every = 200_000, 1, 2
        config.energy = Energy(meter=meter, interval=1e-9)  # a reading at every step
        config.checkpoint = CheckpointConfig(dir=str(tmp_path / meter), every=1, async_save=False)
        return train(config)

    import os

    import torch

    threads, env = torch.get_num_threads(), dict(os.environ)
    try:  # in this process: the run sets torch's threads and the rendezvous variables
        on, off = run("estimate"), run("off")
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)
    capsys.readouterr()
    assert on.losses == off.losses
    assert on.energy["source"] == "estimated" and on.energy["steps"] == 3
    # the first reading, one per step, and the last one at the end of the loop
    assert len(on.energy["ranks"][0]["trace"]) == 5 and on.carbon["intensity_source"] == "default"
    assert off.energy == {} and off.carbon == {}
    # by phase: the evaluation at step 2 and the saves at steps 1 and 2 (the final ones are not metered)
    phases = on.energy["ranks"][0]["phases"]
    assert phases["eval"]["count"] == 1 and phases["checkpoint"]["count"] == 2
    job = on.energy["phases"]
    assert set(job) == {"train", "eval", "checkpoint"} and min(job.values()) >= 0
    assert sum(job.values()) == pytest.approx(on.energy["joules"])
    from torsh_distributed.energy.report import format_report

    text = format_report({"energy": on.energy, "carbon": on.carbon})
    assert "  phases:  train " in text and ", eval " in text and ", checkpoint " in text


def test_phases_take_their_blocks_joules_and_train_is_the_rest():
    wall, cpu = _Clock(0.0), _Clock(0.0)
    tracker = EnergyTracker(EnergyConfig(interval=3600.0), CarbonConfig(intensity=100.0),
                            meter=CpuTimeEstimate(watts_per_core=10.0, cpu_seconds=cpu), clock=wall)
    with tracker.phase("eval"):  # before start: nothing to measure against
        cpu.t += 1.0
    tracker.start()
    for step in range(4):
        wall.t += 1.0
        cpu.t += 0.5  # 5 J per step
        tracker.step_end()
        if step % 2:
            with tracker.phase("eval"):
                cpu.t += 0.2  # 2 J
        with tracker.phase("checkpoint"):
            cpu.t += 0.1  # 1 J
    energy, _ = tracker.finish(gather=lambda row: [row])
    with tracker.phase("checkpoint"):  # after finish (the final save): not counted
        cpu.t += 1.0
    assert energy["joules"] == pytest.approx(28.0)
    assert energy["phases"] == pytest.approx({"train": 20.0, "eval": 4.0, "checkpoint": 4.0})
    assert energy["ranks"][0]["phases"]["eval"]["count"] == 2
    assert tracker.phases["checkpoint"][2] == 4


def test_tracker_logs_the_latest_reading_to_the_monitor_after_every_step():
    wall, cpu = _Clock(0.0), _Clock(0.0)
    logged: list[tuple[str, float]] = []
    tracker = EnergyTracker(EnergyConfig(interval=1e-9), CarbonConfig(intensity=1.0),
                            meter=CpuTimeEstimate(watts_per_core=2.0, cpu_seconds=cpu), clock=wall,
                            log=lambda name, value: logged.append((name, value)))
    tracker.start()
    for _ in range(2):
        wall.t += 2.0
        cpu.t += 1.0  # 2 J over 2 s: 1 W
        tracker.step_end()
    names = ["energy_joules", "energy_w", "carbon_grams"]
    assert [n for n, _ in logged] == names * 2
    assert [v for _, v in logged] == pytest.approx([2.0, 1.0, 2.0 / 3.6e6, 4.0, 1.0, 4.0 / 3.6e6])  # 1 g/kWh


def test_a_series_that_ended_before_the_run_warns_on_rank_0(tmp_path: Path):
    (tmp_path / "old.csv").write_text("timestamp,intensity\n1000,100\n1060,300\n")
    carbon = CarbonConfig(series=str(tmp_path / "old.csv"))
    wall, cpu = _Clock(1120.0 + 7200), _Clock(0.0)
    tracker = EnergyTracker(EnergyConfig(), carbon, meter=CpuTimeEstimate(cpu_seconds=cpu), clock=wall)
    with pytest.warns(UserWarning, match=r"last slot ends 2.0 h before the run starts; its last value \(300 g/kWh\) holds"):
        tracker.start()
    wall.t += 10
    cpu.t += 1.0
    tracker.step_end()
    _, block = tracker.finish(gather=lambda row: [row])
    assert block["intensity_source"] == "series" and block["seconds_outside_series"] == pytest.approx(10.0)
    assert block["grams"] == pytest.approx(4.0 / 3.6e6 * 300)


def test_a_long_run_keeps_a_bounded_trace_and_the_exact_integral(tmp_path: Path):
    rows = "\n".join(f"{60 * i},{100 + 10 * (i % 7)}" for i in range(200))
    (tmp_path / "s.csv").write_text("timestamp,intensity\n" + rows + "\n")
    wall, cpu = _Clock(0.0), _Clock(0.0)
    tracker = EnergyTracker(EnergyConfig(interval=1e-9), CarbonConfig(series=str(tmp_path / "s.csv")),
                            meter=CpuTimeEstimate(watts_per_core=1.0, cpu_seconds=cpu), clock=wall)
    tracker.start()
    times, joules = [0.0], [0.0]
    for i in range(3000):  # 3000 readings of 3.7 s at changing power
        wall.t += 3.7
        cpu.t += 1.0 + (i % 5)
        tracker.step_end()
        times.append(wall.t)
        joules.append(cpu.t)
    from torsh_distributed.energy import load_series

    expected, _ = grams_of_trace(times, joules, load_series(tmp_path / "s.csv"))
    energy, carbon = tracker.finish(gather=lambda row: [row])
    assert carbon["grams"] == pytest.approx(expected, rel=1e-12)
    assert energy["joules"] == pytest.approx(joules[-1]) and energy["ranks"][0]["readings"] == 3001
    trace = energy["ranks"][0]["trace"]
    assert len(trace) < 2 * 120 + 1 and trace[0] == [0.0, 0.0] and trace[-1][1] == pytest.approx(joules[-1])


def test_train_refuses_an_unreadable_meter_before_any_rank_starts(tmp_path: Path, capfd):
    from torsh_distributed.cli.main import main

    code = main(["train", "--nproc-per-node", "2", "--max-steps", "2", "--energy.meter", "rapl",
                 "--energy.powercap-root", str(tmp_path / "none")])
    out, err = capfd.readouterr()
    assert code == 2 and "[rank" not in out
    assert f"--energy.meter rapl: {tmp_path / 'none'} does not exist (no powercap interface" in err
    code = main(["train", "--max-steps", "2", "--carbon.series", str(tmp_path / "none.csv")])
    assert code == 2 and "carbon.series: " in capfd.readouterr().err
