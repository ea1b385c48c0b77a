"""Utility vs privacy of federated training: accuracy against epsilon for several noise levels.

Each configuration is a real ``torsh-dist federated`` run (SuperLink, SuperNodes, Flower's
DP-FedAvg wrapper with server-side clipping, Opacus's RDP accountant), one after the other in one
invocation: scikit-learn's digits (``examples/federated_digits.py``), IID over ``--clients``
clients, ``--fraction`` of them sampled per round (the accountant's sampling rate), the same
rounds, local steps, clipping norm and seed; only ``--noise-multiplier`` changes (0 = no DP, the
reference). Reported per run: the server's held-out accuracy and loss after the last round, and
the epsilon spent at ``--delta``.

    .venv/bin/python benchmarks/bench_federated_privacy.py --json fl_dp.json
    .venv/bin/python benchmarks/bench_federated_privacy.py --noise 0,1 --rounds 3   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "federated_digits.py"
CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]


def run(noise: float, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / f"z{noise:g}.json"
    argv = [
        *CLI, "federated", "--model", f"{DIGITS}:make_model", "--dataset", f"{DIGITS}:train_set",
        "--val-dataset", f"{DIGITS}:test_set", "--partition", "iid", "--clients", str(args.clients),
        "--fraction", str(args.fraction), "--min-clients", str(max(1, int(args.clients * args.fraction))),
        "--rounds", str(args.rounds), "--local-steps", str(args.local_steps), "--batch-size", "16",
        "--lr", "0.1", "--run-dir", str(tmp / f"run_z{noise:g}"), "--resume", "never",
        "--summary-json", str(out), "--timeout", "1800",
    ]  # fmt: skip
    if noise:
        argv += ["--noise-multiplier", str(noise), "--clipping-norm", str(args.clip), "--delta", str(args.delta)]
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"z={noise}: the run failed\n{(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads(out.read_text())
    last = summary["rounds"][-1]
    return {
        "noise_multiplier": noise,
        "epsilon": summary.get("epsilon", float("inf")) if noise else float("inf"),
        "accuracy": last.get("accuracy"),
        "loss": last["loss"],
        "accuracy_by_round": [r.get("accuracy") for r in summary["rounds"]],
        "wall_s": time.monotonic() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise", default="0,0.5,1,2", help="noise multipliers (0 = no DP)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--clip", type=float, default=1.0, help="clipping norm C")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="fl-dp-") as tmp:
        for noise in (float(z) for z in args.noise.split(",")):
            results.append(run(noise, args, Path(tmp)))
            r = results[-1]
            print(f"z={noise:g}: accuracy {r['accuracy']:.3f}, epsilon {r['epsilon']:.2f}, {r['wall_s']:.0f} s", flush=True)
    print(f"\n{args.clients} clients, {args.fraction:g} sampled per round (q), {args.rounds} rounds, C={args.clip:g}, "
          f"delta={args.delta:g}")
    print(f"{'noise z':>8} | {'epsilon':>8} | {'accuracy':>8} | {'loss':>7}")
    for r in results:
        eps = "no DP" if r["noise_multiplier"] == 0 else f"{r['epsilon']:.2f}"
        print(f"{r['noise_multiplier']:8g} | {eps:>8} | {r['accuracy']:8.3f} | {r['loss']:7.3f}")
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
                "cpus": os.cpu_count(), **{k: v for k, v in vars(args).items() if k != "json"}}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
