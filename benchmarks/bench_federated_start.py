"""How Flower ClientApps start: ``--start-method spawn`` (Flower's own SuperExec, a fresh
``flwr-clientapp`` interpreter per message) against ``forkserver`` (forked from a server per
SuperNode that imported torch, Flower and the engine once: ``federated/_warm_node.py``), paired in
one invocation, the order alternating from pair to pair so both see the same machine.

Two measurements per start method and pair:

* ``rounds``: ``torsh-dist federated`` as a user starts it (a subprocess: SuperLink, one SuperNode
  per client, the engine's ServerApp and ClientApp) with FedAvg on scikit-learn's digits
  (``examples/federated_digits.py``), IID, ``--clients`` clients, ``--rounds`` rounds of 10 local
  steps (a train message per client and round): each round's seconds from its ``--summary-json``
  (sent to aggregated) and the command's wall time;
* ``probe``: a user's own Flower app with nothing of torsh_distributed
  (tests/integration/_federated_probe_app) sends ``--messages`` query messages to each of
  ``--clients`` nodes, one message per node at a time; each ClientApp process reports the seconds
  (wall and its own CPU) from its creation to the app's handler, which imports torch first, and
  the server the round trip.

    .venv/bin/python benchmarks/bench_federated_start.py --pairs 2 --json start.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "federated_digits.py"
PROBE = ROOT / "tests" / "integration" / "_federated_probe_app"
METHODS = ("spawn", "forkserver")


def _rounds(method: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir, out = work / f"rounds-{method}", work / f"rounds-{method}.json"
    cmd = [sys.executable, "-m", "torsh_distributed.cli.main", "federated",
           "--model", f"{DIGITS}:make_model", "--dataset", f"{DIGITS}:train_set", "--val-dataset", f"{DIGITS}:test_set",
           "--partition", "iid", "--clients", str(args.clients), "--rounds", str(args.rounds),
           "--local-steps", "10", "--run-dir", str(run_dir), "--resume", "never",
           "--summary-json", str(out), "--start-method", method]  # fmt: skip
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{method}: torsh-dist federated failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    rounds = json.loads(out.read_text())["rounds"]
    return {"round_s": [r["seconds"] for r in rounds], "wall_s": wall, "load": load}


def _probe(method: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from torsh_distributed.federated.config import FederatedConfig
    from torsh_distributed.federated.deploy import Federation

    app, result = work / f"probe-{method}", work / f"probe-{method}.json"
    shutil.copytree(PROBE, app)
    config = FederatedConfig(clients=args.clients, run_dir=str(work / f"probe-run-{method}"))
    lines: list[str] = []
    fed = Federation(config, echo=lines.append, start_method=method)
    load = os.getloadavg()[0]
    with fed.running():
        code = fed.submit(timeout=args.timeout, app=app,
                          run_config=f'messages={args.messages} nodes={args.clients} result="{result}"')  # fmt: skip
    if code != 0:
        raise SystemExit(f"{method}: probe run failed: {lines[-20:]}")
    replies = json.loads(result.read_text())
    assert all(r["torch-before-app"] == (method == "forkserver") for r in replies), replies
    return {"start_to_handler_s": [r["start-to-handler-s"] for r in replies],
            "cpu_to_handler_s": [r["cpu-to-handler-s"] for r in replies],
            "round_trip_s": sorted({round(r["round-trip-s"], 6) for r in replies}), "load": load}  # fmt: skip


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="pairs of runs (spawn and forkserver each)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=3, help="probe: messages per node")
    parser.add_argument("--only", choices=("rounds", "probe"), help="one of the two measurements")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results: dict[str, dict[str, list[Any]]] = {m: {"rounds": [], "probe": []} for m in METHODS}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fl-start-") as tmp:
        for pair in range(args.pairs):
            order = METHODS if pair % 2 == 0 else METHODS[::-1]
            for method in order:
                work = Path(tmp) / f"pair{pair}"
                work.mkdir(exist_ok=True)
                for what, fn in (("probe", _probe), ("rounds", _rounds)):
                    if args.only in (None, what):
                        res = fn(method, work, args)
                        results[method][what].append(res)
                        print(f"pair {pair + 1} {method:10s} {what}: {json.dumps(res)}", flush=True)
    print(f"\n{'':34s}{'spawn':>10s}{'forkserver':>12s}{'ratio':>8s}")
    rows = [
        ("probe: process start -> handler s", "probe", "start_to_handler_s"),
        ("probe: CPU s until the handler", "probe", "cpu_to_handler_s"),
        ("probe: message round trip s", "probe", "round_trip_s"),
        ("rounds: seconds per round", "rounds", "round_s"),
        ("rounds: command wall s", "rounds", "wall_s"),
    ]
    for label, what, key in rows:
        med = {}
        for m in METHODS:
            values = [v for r in results[m][what] for v in (r[key] if isinstance(r[key], list) else [r[key]])]
            med[m] = _median(values)
        if med["spawn"] == med["spawn"]:
            print(f"{label:34s}{med['spawn']:10.2f}{med['forkserver']:12.2f}{med['spawn'] / med['forkserver']:7.2f}x")
    print(f"(medians over {args.pairs} pairs; benchmark wall {time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "cpus": os.cpu_count(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
