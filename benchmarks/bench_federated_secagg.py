"""The cost of secure aggregation: plain FedAvg vs SecAgg+ rounds of the same job, side by side.

Both are real ``torsh-dist federated`` runs on loopback (a SuperLink, ``--clients`` SuperNodes)
of the same digits job (``examples/federated_digits.py``, IID, FedAvg, the same seed), one after
the other in one invocation; the second adds ``--secagg``. Reported: mean round time, bytes per
round (SecAgg+: every message of its four stages), and the server's accuracy after the last
round (SecAgg+'s aggregate equals plain FedAvg's within its quantisation bound, so the two
should agree closely).

    .venv/bin/python benchmarks/bench_federated_secagg.py --json fl_secagg.json
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


def run(secagg: bool, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    name = "secagg" if secagg else "plain"
    out = tmp / f"{name}.json"
    argv = [
        *CLI, "federated", "--model", f"{DIGITS}:{args.model}", "--dataset", f"{DIGITS}:train_set",
        "--val-dataset", f"{DIGITS}:test_set", "--partition", "iid", "--clients", str(args.clients),
        "--min-clients", str(args.clients), "--rounds", str(args.rounds), "--local-steps", "10",
        "--batch-size", "16", "--lr", "0.1", "--run-dir", str(tmp / name), "--resume", "never",
        "--summary-json", str(out), "--timeout", "1800", *(["--secagg"] if secagg else []),
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: the run failed\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = json.loads(out.read_text())["rounds"]
    return {
        "mode": name,
        "round_s": sum(r["seconds"] for r in rows) / len(rows),
        "bytes_per_round": sum(r["bytes"]["total"] for r in rows) / len(rows),
        "up_per_round": sum(r["bytes"]["up"] for r in rows) / len(rows),
        "accuracy": rows[-1].get("accuracy"),
        "error_bound": rows[-1].get("secagg", {}).get("error_bound"),
        "wall_s": time.monotonic() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="make_model", help="make_model or make_wide_model (1.1 M parameters)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fl-secagg-") as tmp:
        results = [run(False, args, Path(tmp)), run(True, args, Path(tmp))]
    plain, secure = results
    print(f"{args.clients} clients, {args.rounds} rounds, {args.model}")
    print(f"{'mode':>7} | {'round s':>8} | {'MB/round':>9} | {'up MB/round':>11} | {'accuracy':>8}")
    for r in results:
        print(f"{r['mode']:>7} | {r['round_s']:8.1f} | {r['bytes_per_round'] / 1e6:9.3f} | "
              f"{r['up_per_round'] / 1e6:11.3f} | {r['accuracy']:8.3f}")
    print(f"SecAgg+ / plain: time {secure['round_s'] / plain['round_s']:.2f}x, bytes "
          f"{secure['bytes_per_round'] / plain['bytes_per_round']:.2f}x; error bound {secure['error_bound']:.2e}")
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
                "cpus": os.cpu_count(), **{k: v for k, v in vars(args).items() if k != "json"}}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
