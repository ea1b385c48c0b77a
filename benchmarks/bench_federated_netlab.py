"""Federated rounds over slow links: round time and bytes with and without compressed updates.

Hosts are network namespaces (benchmarks/netlab): host 0 runs ``torsh-dist federated
--remote-nodes`` (the SuperLink behind the token relay), hosts 1..C each run ``torsh-dist
federated-node``; every host's link is shaped to ``--rate-mbit`` (10 Mbit by default) each way,
so the server's link carries C copies of the model down and C updates up per round. The model is
``examples/federated_digits.py:make_wide_model`` (1.13 M parameters, 4.5 MB in fp32) on the
digits, IID, FedAvg; every compression method runs the same rounds in the same invocation, one
after the other. Reported per method: mean round time (rounds 2.., so process start-up of round 1
is left out), bytes up per round (what the clients sent), bytes down, and the server's accuracy
after the last round.

    sudo .venv/bin/python benchmarks/bench_federated_netlab.py --json fl_net.json
    .venv/bin/python benchmarks/bench_federated_netlab.py --methods none,topk:0.01 --rounds 3
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from netlab import NetLab, available  # noqa: E402

DIGITS = ROOT / "examples" / "federated_digits.py"
CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
TOKEN_ENV = "TORSH_FL_BENCH_TOKEN"


def run_method(lab: NetLab, method: str, *, clients: int, rounds: int, out: Path, port: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", TOKEN_ENV: "bench-token-" + "x" * 16}
    head = lab.address(0)
    summary_path = out / f"{method.replace(':', '_')}.json"
    argv = [
        *CLI, "federated", "--model", f"{DIGITS}:make_wide_model", "--dataset", f"{DIGITS}:train_set",
        "--val-dataset", f"{DIGITS}:test_set", "--partition", "iid", "--clients", str(clients),
        "--min-clients", str(clients), "--rounds", str(rounds), "--local-steps", "5", "--batch-size", "32",
        "--lr", "0.05", "--compression", method, "--run-dir", str(out / f"run_{method.replace(':', '_')}"),
        "--resume", "never", "--superlink-host", head, "--superlink-port", str(port), "--remote-nodes",
        "--token-env", TOKEN_ENV, "--summary-json", str(summary_path), "--timeout", "1200",
    ]  # fmt: skip
    started = time.monotonic()
    server = lab.popen(0, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    nodes = [
        lab.popen(
            host,
            [*CLI, "federated-node", "--superlink", f"{head}:{port}", "--partition-id", str(host - 1),
             "--num-partitions", str(clients), "--token-env", TOKEN_ENV],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for host in range(1, clients + 1)
    ]
    text, _ = server.communicate(timeout=1500)
    wall = time.monotonic() - started
    for node in nodes:
        node.terminate()
    for node in nodes:
        try:
            node.wait(timeout=15)
        except subprocess.TimeoutExpired:
            node.kill()
    if server.returncode != 0:
        raise RuntimeError(f"{method}: the run failed\n{text.decode(errors='replace')[-3000:]}")
    summary = json.loads(summary_path.read_text())
    rows = summary["rounds"]
    later = rows[1:] or rows
    return {
        "method": method,
        "round_s": sum(r["seconds"] for r in later) / len(later),
        "up_bytes": sum(r["bytes"]["up"] for r in rows) / len(rows),
        "down_bytes": sum(r["bytes"]["down"] for r in rows) / len(rows),
        "accuracy": rows[-1].get("accuracy"),
        "loss": rows[-1]["loss"],
        "wall_s": wall,
        "rounds": [{k: r[k] for k in ("round", "loss", "seconds")} for r in rows],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="none,int8,topk:0.01,powersgd:4")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=10.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    reason = available()
    if reason:
        print(f"network lab unavailable: {reason}", file=sys.stderr)
        return 2
    methods = args.methods.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="fl-netlab-") as tmp, NetLab(
        hosts=args.clients + 1, rate_mbit=args.rate_mbit, net=61
    ) as lab:
        for i, method in enumerate(methods):
            results.append(run_method(lab, method, clients=args.clients, rounds=args.rounds, out=Path(tmp), port=29800 + i))
            r = results[-1]
            print(f"{method:>12}: round {r['round_s']:.1f} s, up {r['up_bytes'] / 1e6:.2f} MB, "
                  f"down {r['down_bytes'] / 1e6:.2f} MB, acc {r['accuracy']}", flush=True)
    base = results[0]
    print(f"\n{args.clients} clients, {args.rate_mbit:g} Mbit per host link, {args.rounds} rounds; round time "
          "of rounds 2.. (mean)")
    print(f"{'method':>12} | {'round s':>8} | {'vs none':>7} | {'up MB/round':>11} | {'up vs none':>10} | "
          f"{'down MB/round':>13} | {'accuracy':>8}")
    for r in results:
        print(f"{r['method']:>12} | {r['round_s']:8.1f} | {base['round_s'] / r['round_s']:6.2f}x | "
              f"{r['up_bytes'] / 1e6:11.2f} | {base['up_bytes'] / r['up_bytes']:9.1f}x | "
              f"{r['down_bytes'] / 1e6:13.2f} | {r['accuracy'] if r['accuracy'] is None else round(r['accuracy'], 3)!s:>8}")
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
                "cpus": os.cpu_count(), "rate_mbit": args.rate_mbit, "clients": args.clients, "rounds": args.rounds}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
