"""Federated rounds against Flower's idle polls: ``torsh-dist federated --poll S`` for each S of
``--polls`` (3 = Flower's own sleeps; ``federated/_flower_polls.py``), paired in one invocation,
the order rotating from pair to pair so every setting sees the same machine.

Each run is ``torsh-dist federated`` as a user starts it (a subprocess: SuperLink, one SuperNode
per client, the engine's ServerApp and ClientApps, forked warm) with FedAvg on scikit-learn's
digits (``examples/federated_digits.py``), IID, ``--clients`` clients, ``--rounds`` rounds of
``--local-steps`` local steps and an evaluation per round (``--fraction-evaluate 1``). Per run:
each round's seconds from its ``--summary-json`` (sent to aggregated), the command's wall time,
and the CPU seconds of the command and everything it started and waited for (``RUSAGE_CHILDREN``).

    .venv/bin/python benchmarks/bench_federated_polls.py --pairs 3 --json polls.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "federated_digits.py"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(poll: float, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir, out = work / f"run-{poll:g}", work / f"run-{poll:g}.json"
    cmd = [sys.executable, "-m", "torsh_distributed.cli.main", "federated",
           "--model", f"{DIGITS}:make_model", "--dataset", f"{DIGITS}:train_set", "--val-dataset", f"{DIGITS}:test_set",
           "--partition", "iid", "--clients", str(args.clients), "--rounds", str(args.rounds),
           "--local-steps", str(args.local_steps), "--fraction-evaluate", "1", "--run-dir", str(run_dir),
           "--resume", "never", "--summary-json", str(out), "--poll", f"{poll:g}"]  # fmt: skip
    load = os.getloadavg()[0]
    cpu0, started = _children_cpu(), time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    wall, cpu = time.perf_counter() - started, _children_cpu() - cpu0
    if done.returncode != 0 or not out.exists():
        raise SystemExit(
            f"--poll {poll:g}: torsh-dist federated failed ({done.returncode}): "
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    rounds = json.loads(out.read_text())["rounds"]
    return {
        "round_s": [r["seconds"] for r in rounds],
        "wall_s": wall,
        "cpu_s": cpu,
        "load": load,
        "val_loss": rounds[-1].get("val_loss"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--polls",
        type=float,
        nargs="+",
        default=[3.0, 0.25],
        help="the --poll settings compared (3 = Flower's own)",
    )
    parser.add_argument("--pairs", type=int, default=3, help="runs of every setting")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {f"{p:g}": [] for p in args.polls}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fl-polls-") as tmp:
        for pair in range(args.pairs):
            shift = pair % len(args.polls)
            for poll in args.polls[shift:] + args.polls[:shift]:
                work = Path(tmp) / f"pair{pair}"
                work.mkdir(exist_ok=True)
                res = _run(poll, work, args)
                results[f"{poll:g}"].append(res)
                print(f"pair {pair + 1} --poll {poll:<5g} {json.dumps(res)}", flush=True)
    base = f"{args.polls[0]:g}"
    print(f"\n{'--poll':>8s}{'s/round':>10s}{'wall s':>9s}{'CPU s':>8s}{'round vs ' + base:>16s}")
    for key, runs in results.items():
        per_round = statistics.median(s for r in runs for s in r["round_s"])
        base_round = statistics.median(s for r in results[base] for s in r["round_s"])
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        print(f"{key:>8s}{per_round:10.2f}{wall:9.1f}{cpu:8.1f}{per_round / base_round:15.2f}x")
    print(
        f"(medians over {args.pairs} runs each, {args.clients} clients x {args.rounds} rounds; "
        f"load at start {min(r['load'] for rs in results.values() for r in rs):.1f}-"
        f"{max(r['load'] for rs in results.values() for r in rs):.1f}; "
        f"benchmark wall {time.perf_counter() - started:.0f} s)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"argv": sys.argv[1:], "cpus": os.cpu_count(), "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
