"""Carbon saved and time added by carbon-aware time shifting and scaling, against a
carbon-agnostic run of the same job, on one real day of a grid's hourly carbon intensity
compressed in time.

The day: California ISO (Electricity Maps zone ``US-CAL-CISO``), 2020-01-01 00:00-23:00 UTC,
hourly ``carbon_intensity_avg`` in gCO2eq/kWh (Electricity Maps' lifecycle figures), as shipped
in the CarbonScaler authors' sample file ``carbon_service/data-sample.csv`` of
https://github.com/umassos/CarbonScaler. Solar makes 16:00-23:00 UTC (8 am-3 pm in California)
clean; the night is dirty.

Three runs of the same job (``torsh-dist train``, tiny GPT, ``--threads 1``), one after another,
each with the day written as a series that starts at its own launch at ``--start-hour``, one
hour lasting ``--hour-s`` seconds:

* ``agnostic``: ``--nproc-per-node N`` (``--max-workers``, 2); the series only prices the energy;
* ``shifting``: ``--nproc-per-node N --carbon.max-intensity X`` (pause while above X);
* ``scaling``:  ``--nproc-per-node 1:N --carbon.scale`` (N workers at the day's cleanest hour,
  1 at its dirtiest, linear between).

For each: the wall time from launch to exit, the metered training energy and grams from the
summary (the estimate: CPU time x 4 W per busy core; scaling's summed over its segments), and the
whole process tree's CPU time x the same 4 W integrated over the series (psutil samples every
0.2 s, closed by ``getrusage`` of the finished tree): that one includes start-up, restarts,
checkpoints and evaluation, which the meter does not count. Idle power is counted by neither, so
a pause costs nothing here (on real hardware an idle node still draws power unless released).

    .venv/bin/python benchmarks/bench_carbon.py --steps 600 --hour-s 4 --start-hour 12
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from torsh_distributed.energy.carbon import grams_of_trace, load_series
from torsh_distributed.energy.estimate import DEFAULT_WATTS_PER_CORE

DAY = (  # US-CAL-CISO, 2020-01-01, hours 00..23 UTC, carbon_intensity_avg (gCO2eq/kWh)
    332.39, 363.37, 355.37, 346.76, 349.2, 355.73, 357.13, 359.68, 363.4, 364.25, 355.43, 352.59,
    343.96, 346.22, 338.61, 339.92, 280.65, 239.42, 217.39, 209.18, 209.31, 211.1, 205.11, 226.8,
)
SOURCE = ("Electricity Maps US-CAL-CISO 2020-01-01 UTC hourly carbon_intensity_avg, from "
          "umassos/CarbonScaler carbon_service/data-sample.csv")


def _series(path: Path, *, start: float, start_hour: int, hour_s: float) -> None:
    hours = [DAY[(start_hour + i) % 24] for i in range(72)]  # three days: the job never runs off it
    path.write_text("timestamp,gCO2/kWh\n" + "".join(f"{start + hour_s * i:.3f},{v}\n" for i, v in enumerate(hours)))


def _tree_cpu(proc: psutil.Process, seen: dict[int, float]) -> float:
    """CPU seconds of ``proc`` and its descendants, keeping the last figure of exited ones."""
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            seen[p.pid] = max(seen.get(p.pid, 0.0), t.user + t.system)
        except psutil.Error:
            pass
    return sum(seen.values())


def _run(name: str, flags: list[str], common: list[str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_dir = work / name
    run_dir.mkdir()
    start = time.time()
    _series(run_dir / "day.csv", start=start, start_hour=args.start_hour, hour_s=args.hour_s)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "-m", "torsh_distributed.cli.main", "train", *common, *flags,
           "--carbon.series", str(run_dir / "day.csv"), "--summary-json", str(run_dir / "summary.json")]
    with open(run_dir / "out.log", "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir)
        proc, seen = psutil.Process(child.pid), {}
        times, cpu = [start], [0.0]
        while child.poll() is None:
            try:
                cpu.append(_tree_cpu(proc, seen))
                times.append(time.time())
            except psutil.Error:
                pass
            time.sleep(0.2)
    ended = time.time()
    if child.returncode:
        raise SystemExit(f"{name} failed ({child.returncode}); see {run_dir / 'out.log'}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    total_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    times.append(ended)
    cpu.append(max(total_cpu, cpu[-1]))
    joules = [c * DEFAULT_WATTS_PER_CORE for c in cpu]
    tree_grams, _ = grams_of_trace(times, joules, load_series(run_dir / "day.csv"))
    summary = json.loads((run_dir / "summary.json").read_text())
    carbon = summary["carbon"]
    scaling = carbon.get("scaling")
    return {
        "run": name,
        "wall_s": ended - start,
        "metered_j": scaling["joules"] if scaling else summary["energy"]["joules"],
        "metered_g": scaling["grams"] if scaling else carbon["grams"],
        "tree_j": joules[-1],
        "tree_g": tree_grams,
        "final_loss": summary["final_loss"],
        "paused_s": carbon.get("paused_s"),
        "world_sizes": scaling["world_sizes"] if scaling else None,
        "decisions": scaling["decisions"] if scaling else None,
        "start": start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="training steps of the job")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--hour-s", type=float, default=4.0, help="seconds per hour of the day")
    parser.add_argument("--start-hour", type=int, default=12, help="hour of the day (UTC) the job starts at")
    parser.add_argument("--max-intensity", type=float, default=300.0, help="time shifting's threshold")
    parser.add_argument("--max-workers", type=int, default=2,
                        help="workers of the agnostic and shifting runs; scaling runs 1 to this many")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    common = ["--preset", "tiny", "--data.max-bytes", "400000", "--max-steps", str(args.steps),
              "--batch-size", str(args.batch_size), "--eval-batches", "1", "--progress", "false",
              "--threads", "1", "--checkpoint.dir", "ckpt"]
    runs = {
        "agnostic": ["--nproc-per-node", str(args.max_workers)],
        "shifting": ["--nproc-per-node", str(args.max_workers), "--carbon.max-intensity", f"{args.max_intensity:g}"],
        "scaling": ["--nproc-per-node", f"1:{args.max_workers}", "--carbon.scale"],
    }
    with tempfile.TemporaryDirectory(prefix="bench-carbon-") as tmp:
        results = [_run(name, flags, common, args, Path(tmp)) for name, flags in runs.items()]
    base = results[0]
    hours = [DAY[(args.start_hour + i) % 24] for i in range(24)]
    print(f"day: {SOURCE}; hour {args.start_hour} first, {args.hour_s:g} s per hour; "
          f"{args.steps} steps, global batch {args.batch_size}, tiny GPT, --threads 1, "
          f"{args.max_workers} workers (scaling: 1 to {args.max_workers}), {os.cpu_count()} CPUs")
    print(f"intensity from the start (g/kWh): {', '.join(f'{v:.0f}' for v in hours)}\n")
    print("| run | wall s | time added | metered J | metered g | tree J | tree g | carbon saved (tree) | final loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['run']} | {r['wall_s']:.1f} | {r['wall_s'] / base['wall_s'] - 1:+.0%} | {r['metered_j']:.1f} "
              f"| {r['metered_g']:.3g} | {r['tree_j']:.1f} | {r['tree_g']:.3g} "
              f"| {1 - r['tree_g'] / base['tree_g']:+.1%} | {r['final_loss']:.4f} |")
    shifting, scaling = results[1], results[2]
    print(f"\nshifting paused {shifting['paused_s']:.1f} s; scaling ran world sizes {scaling['world_sizes']} "
          "starting at hours " + ", ".join(
              f"{args.start_hour + (d['unix_s'] - scaling['start']) / args.hour_s:.1f} ({d['intensity']:g} g/kWh)"
              for d in scaling["decisions"]))
    print("metered: the summary's training-step energy (estimate: CPU time x 4 W/core; scaling: all segments);"
          " tree: every process of the run, start-up and restarts included")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
