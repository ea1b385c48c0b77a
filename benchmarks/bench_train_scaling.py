"""Throughput of `torsh-dist train` at 1, 2 (and more) local ranks, measured side by side.

Runs the built-in trainer through the real CLI (`torsh-dist train --nproc-per-node N`) for each N,
reads the summary JSON, and prints tokens/s, wall time and the ratio to N=1. Same flags for every
N: the global batch is fixed, so every run computes the same samples per step.

    .venv/bin/python benchmarks/bench_train_scaling.py --nprocs 1 2 --preset tiny --max-steps 100

On a 2-core machine, 2 ranks share the cores (threads per rank = cores / ranks), so the ratio
shows the cost of data parallelism (gradient all-reduce over Gloo) rather than a speed-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(nproc: int, preset: str, max_steps: int, batch_size: int, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torsh_distributed.cli.main", "train",
        "--nproc-per-node", str(nproc), "--preset", preset, "--max-steps", str(max_steps),
        "--batch-size", str(batch_size), "--progress", "false", "--summary-json", str(out),
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    summary = json.loads(out.read_text())
    summary["process_wall_s"] = time.perf_counter() - start
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats; best is kept")
    args = parser.parse_args()

    best: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for n in args.nprocs:
                res = run_once(n, args.preset, args.max_steps, args.batch_size, Path(tmp) / f"{n}-{rep}.json")
                if n not in best or res["tokens_per_s"] > best[n]["tokens_per_s"]:
                    best[n] = res
    base = best[args.nprocs[0]]["tokens_per_s"]
    print(f"# machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"# preset {args.preset}, {args.max_steps} steps, global batch {args.batch_size}, best of {args.repeats}")
    print("| ranks | tokens/s | ratio vs first | final loss | val loss | process wall (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.nprocs:
        r = best[n]
        print(f"| {n} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f} | "
              f"{r['final_loss']:.3f} | {r['val_loss']:.3f} | {r['process_wall_s']:.1f} |")


if __name__ == "__main__":
    main()
