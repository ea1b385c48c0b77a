"""Cost of energy metering: the monitored step time with the meter off vs on, side by side.

Two ranks (Gloo, CPU) train the ``tiny`` model repeatedly in the same processes with
``--monitor`` on, cycling through three settings so machine drift hits each equally: the meter
``off``; ``on`` (``--energy.meter auto``, a reading every ``--energy.interval`` 1 s, the default);
and ``every step`` (a reading after every step, the worst case). Also times, in this process, the
per-step hook alone (``EnergyTracker.step_end`` between readings) and one reading of each meter
this host can open (the CPU-time estimate here; RAPL on a fake powercap tree in a temporary
directory, which costs the same file reads as sysfs)::

    .venv/bin/python benchmarks/bench_energy.py --steps 150 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torsh_distributed.energy import (
    CarbonConfig,
    CpuTimeEstimate,
    EnergyConfig,
    EnergyTracker,
    RaplMeter,
)
from torsh_distributed.monitor import MonitorConfig
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

MODES = {"off": ("off", 1.0), "on": ("auto", 1.0), "every step": ("auto", 1e-9)}


def _rank(steps: int, rounds: int) -> list[tuple[str, float, float]]:
    results = []
    names = list(MODES)
    for r in range(rounds):
        order = names[r % 3:] + names[: r % 3]  # rotate: each mode first, second and third
        for mode in order:
            meter, interval = MODES[mode]
            cfg = preset("tiny")
            cfg.max_steps, cfg.progress, cfg.eval_batches = steps, False, 1
            cfg.data.max_bytes = 400_000
            cfg.monitor = MonitorConfig(enabled=True, every=10)
            cfg.energy = EnergyConfig(meter=meter, interval=interval)
            cfg.carbon = CarbonConfig(intensity=300.0)
            result = train(TrainConfig.from_dict(cfg.to_dict()))
            step_ms = cfg.batch_size * cfg.model.block_size / result.tokens_per_s * 1e3
            results.append((mode, step_ms, result.energy.get("joules_per_step", 0.0)))
    return results


def _per_call_us(fn, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations * 1e6


def _direct_costs() -> dict[str, float]:
    tracker = EnergyTracker(EnergyConfig(interval=3600.0), CarbonConfig(intensity=300.0))
    tracker.start()
    costs = {"step_end between readings": _per_call_us(tracker.step_end, 200_000)}
    costs["one reading: estimate (process CPU time)"] = _per_call_us(CpuTimeEstimate().read, 20_000)
    with tempfile.TemporaryDirectory() as root:
        for name, label in (("intel-rapl:0", "package-0"), ("intel-rapl:0:0", "dram"),
                            ("intel-rapl:1", "package-1")):
            zone = Path(root) / name
            zone.mkdir()
            (zone / "name").write_text(label + "\n")
            (zone / "energy_uj").write_text("123456789\n")
            (zone / "max_energy_range_uj").write_text("262143328850\n")
        costs["one reading: RAPL, 3 zones (fake tree, same file reads)"] = _per_call_us(RaplMeter(root).read, 20_000)
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three settings")
    args = parser.parse_args()
    costs = _direct_costs()
    per_rank = run_distributed(_rank, 2, args=(args.steps, args.rounds),
                               timeout=60 + 45 * args.rounds * args.steps / 50)
    runs = per_rank[0]
    by_mode = {m: [r[1] for r in runs if r[0] == m] for m in MODES}
    base = statistics.median(by_mode["off"])
    print(f"tiny preset, 2 ranks (gloo), --monitor on, {args.steps} steps per run, "
          f"{args.rounds} runs per setting (rotated order)\n")
    print("| energy meter | step time per run (ms) | median (ms) | ratio to off | J/step (estimated) |")
    print("|---|---|---:|---:|---:|")
    for mode, times in by_mode.items():
        joules = [r[2] for r in runs if r[0] == mode]
        j = f"{statistics.median(joules):.3g}" if mode != "off" else "-"
        print(f"| {mode} | {', '.join(f'{v:.1f}' for v in times)} | {statistics.median(times):.1f} "
              f"| {statistics.median(times) / base:.3f} | {j} |")
    print("\n| direct cost, in-process | us per call | share of the median 'off' step |")
    print("|---|---:|---:|")
    for what, us in costs.items():
        print(f"| {what} | {us:.2f} | {us / 1e3 / base:.4%} |")
    spread = (max(by_mode["off"]) - min(by_mode["off"])) / base
    direct = (costs["step_end between readings"] + costs["one reading: estimate (process CPU time)"]) / 1e3 / base
    ratio = statistics.median(by_mode["on"]) / base
    print(f"\nrun-to-run spread of the 'off' runs: {spread:.1%} of their median")
    print(f"direct cost per step with a reading at every step (hook + estimate read): {direct:.4%}")
    if spread > 0.02:
        verdict = f"wall-time ratio inconclusive (spread > 2 %); direct cost {'<=' if direct <= 0.01 else '>'} 1 %"
    else:
        verdict = "met" if ratio <= 1.01 else "MISSED"
    print(f"target <= 1.01 (on / off): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
