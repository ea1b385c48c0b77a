"""Which model should ``make demo`` train? Validation loss of candidate set-ups at an equal
compute budget on the demo's 2 local ranks, side by side in one invocation.

``make demo`` has about a minute on a 2-core machine, start-up and sampling included; this
script decides what to spend the training part of it on. Each candidate is a set of
``torsh-dist train`` flags (model size, context, batch, learning rate and schedule). For each:

1. two **probes** of ``P = --probe-steps`` and ``3P`` steps measure its cost per step: the
   difference of the CPU time (user + system, of the launcher and both ranks:
   ``getrusage(RUSAGE_CHILDREN)``) of the two runs over ``2P`` steps, so neither start-up and
   loading nor the slow first steps are counted;
2. the **run** trains ``floor(2 * budget / cost per step)`` steps from scratch (``--resume
   never``): ``--budget`` CPU seconds per rank, what its training takes in wall time on a quiet
   2-core machine (one core per rank; less the time ranks wait for each other), and reports its
   validation loss on ``--eval-batches`` batches, its CPU time and the wall time it took.

CPU time, not wall time, is the budget because the machine this was measured on is shared:
other processes' load stretches wall time (by 2x and more) but hardly the CPU time a run
needs. Candidates run one after another (never two at once), in ``--rounds`` rounds whose
order is rotated; the 1-minute load average is printed before and after each run. Pass
``--steps N`` instead of ``--budget`` to compare at an equal step budget (learning rates and
schedules of one model).

    python benchmarks/bench_demo.py --budget 40                 # 40 CPU s per rank each
    python benchmarks/bench_demo.py --only demo,tiny --budget 40
    python benchmarks/bench_demo.py --only 2L-d64-ctx128-b16 --steps 1600 --lr 3e-3,6e-3,1e-2
    python benchmarks/bench_demo.py --smoke                     # seconds: 2 candidates, 5 steps

``--sample`` also prints a 200-byte sample of every run (``torsh-dist generate``, the demo's
prompt and sampling flags).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = [sys.executable, "-m", "torsh_distributed.cli.main", "train", "--nproc-per-node", "2"]


def _shape(layers: int, width: int, context: int, batch: int) -> list[str]:
    """The tiny preset (2 heads, AdamW at 3e-3, cosine) reshaped, on 2 MB of corpus."""
    return [
        "--preset", "tiny", "--data.max-bytes", "2000000", "--optim.warmup-steps", "20",
        "--model.n-layer", str(layers), "--model.d-model", str(width),
        "--model.block-size", str(context), "--batch-size", str(batch),
    ]  # fmt: skip


CANDIDATES: dict[str, list[str]] = {
    # the demo until issue 28: the tiny preset at a 256-byte context, batch 8 (1 MB of corpus)
    "tiny": ["--preset", "tiny", "--model.block-size", "256", "--batch-size", "8"],
    "demo": ["--preset", "demo"],
    "2L-d64-ctx256-b8": _shape(2, 64, 256, 8),
    "3L-d64-ctx256-b8": _shape(3, 64, 256, 8),
    "4L-d64-ctx256-b8": _shape(4, 64, 256, 8),
    "2L-d96-ctx256-b8": _shape(2, 96, 256, 8),
    "3L-d96-ctx256-b8": _shape(3, 96, 256, 8),
    "4L-d128-ctx256-b16": [*_shape(4, 128, 256, 16), "--model.n-head", "4"],
    "2L-d64-ctx128-b16": _shape(2, 64, 128, 16),
    "2L-d64-ctx128-b32": _shape(2, 64, 128, 32),
    "2L-d64-ctx64-b32": _shape(2, 64, 64, 32),
}
"""Flags per candidate; ``demo`` is the preset ``make demo`` trains (train/config.py)."""


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _train(flags: list[str], steps: int, out: Path, eval_batches: int) -> dict:
    summary = out / "summary.json"
    cmd = [
        *TRAIN,
        *flags,
        "--max-steps",
        str(steps),
        "--eval-batches",
        str(eval_batches),
        "--progress",
        "false",
        "--checkpoint-dir",
        str(out / "ckpt"),
        "--resume",
        "never",
        "--summary-json",
        str(summary),
    ]
    started, cpu = time.perf_counter(), _cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    total, cpu = time.perf_counter() - started, _cpu() - cpu
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    data = json.loads(summary.read_text())
    data["process_s"] = total
    data["cpu_s"] = cpu
    return data


def _sample(ckpt: Path, args: argparse.Namespace) -> str:
    cmd = [
        sys.executable, "-m", "torsh_distributed.cli.main", "generate", "--checkpoint",
        str(ckpt), "--prompt", r"def main():\n", "--max-new-tokens", "200",
        "--temperature", str(args.temperature), "--top-k", str(args.top_k), "--seed", "0",
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=40.0, help="training seconds per run")
    parser.add_argument("--steps", type=int, default=0, help="equal step budget instead")
    parser.add_argument("--only", default="", help="comma-separated candidate names")
    parser.add_argument("--lr", default="", help="comma-separated peak LRs (each a candidate)")
    parser.add_argument("--schedule", default="", help="comma-separated schedules (ditto)")
    parser.add_argument("--probe-steps", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sample", action="store_true", help="print a sample of each run")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="2 candidates, 5 steps")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(CANDIDATES)
    if args.smoke:
        names, args.steps, args.eval_batches, args.rounds = ["tiny", "demo"], 5, 1, 1
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidates {unknown}; choose among {', '.join(CANDIDATES)}")
    runs: dict[str, list[str]] = {}
    for name in names:
        for lr in args.lr.split(",") if args.lr else [""]:
            for schedule in args.schedule.split(",") if args.schedule else [""]:
                flags = list(CANDIDATES[name])
                label = name
                if lr:
                    flags += ["--optim.lr", lr]
                    label += f" lr={lr}"
                if schedule:
                    flags += ["--optim.schedule", schedule]
                    label += f" {schedule}"
                runs[label] = flags
    labels = list(runs)
    results: dict[str, list[dict]] = {label: [] for label in labels}
    print(f"cpus {os.cpu_count()}, load {_load()}; budget "
          f"{f'{args.steps} steps' if args.steps else f'{args.budget:.0f} CPU s per rank'}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
        for r in range(args.rounds):
            order = labels[r % len(labels) :] + labels[: r % len(labels)]
            for label in order:
                out = Path(tmp) / f"{len(results[label])}-{label.replace(' ', '_')}"
                steps = args.steps
                step_cpu = math.nan
                if not steps:
                    # two probes: their difference leaves out start-up and the slow first steps
                    short = _train(runs[label], args.probe_steps, out / "probe1", 1)
                    long = _train(runs[label], 3 * args.probe_steps, out / "probe3", 1)
                    step_cpu = (long["cpu_s"] - short["cpu_s"]) / (2 * args.probe_steps)
                    steps = max(1, int(2 * args.budget / step_cpu))
                before = _load()
                data = _train(runs[label], steps, out, args.eval_batches)
                row = {
                    "steps": steps,
                    "probe_step_cpu_s": step_cpu,
                    "train_s": data["wall_time_s"],
                    "process_s": data["process_s"],
                    "cpu_s": data["cpu_s"],
                    "val_loss": data["val_loss"],
                    "params": data["num_params"],
                    "load": f"{before}->{_load()}",
                }
                results[label].append(row)
                print(f"{label:24s} " + json.dumps(row), flush=True)
                if args.sample:
                    print(_sample(out / "ckpt", args), flush=True)
    print("\n| candidate | params | steps | CPU s | train s | process s | validation loss | load |")
    print("|---|---|---|---|---|---|---|---|")
    for label in labels:
        rows = results[label]
        print(
            f"| {label} | {rows[0]['params']:,} | {rows[0]['steps']} "
            f"| {statistics.median(r['cpu_s'] for r in rows):.1f} "
            f"| {statistics.median(r['train_s'] for r in rows):.1f} "
            f"| {statistics.median(r['process_s'] for r in rows):.1f} "
            f"| {' / '.join(format(r['val_loss'], '.3f') for r in rows)} "
            f"| {', '.join(r['load'] for r in rows)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
