"""A SecAgg+ round that loses clients mid-protocol, with the CLI's default settings.

One real ``torsh-dist federated --secagg`` run on loopback (a SuperLink and ``--clients``
SuperNodes) of the digits job (``examples/federated_digits.py``). When the server says that a
stage has ended (its ``federated: round 1 secagg STAGE: ...`` line; ``share_keys`` by default:
every client has handed shares of its secrets to the others and none has sent its masked update
yet), ``--kill`` SuperNodes are SIGKILLed with their process trees and the ClientApp processes
attached to them, as a host that dies would take them. Nothing else is set: the round timeout,
shares and threshold are the CLI's defaults (6 clients: all 6 hold shares, 4 rebuild a secret).

Reported: whether the round completed, the clients that answered and dropped, the round's and
each stage's seconds, the nodes' measured start-up, and the 1-minute load average sampled every
second during the run (issue 37 asks for completion at load ~15: run it beside other work, e.g.
``scripts/cpu_neighbour.sh``, and read the load it reports).

    .venv/bin/python benchmarks/bench_secagg_dropout.py --clients 6 --kill 2 --json secagg_kill.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "examples" / "federated_digits.py"
CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
STAGES = ("setup", "share_keys", "collect_masked_vectors")


def _supernodes(root: psutil.Process) -> dict[int, psutil.Process]:
    """The run's SuperNodes by partition id."""
    found = {}
    for proc in root.children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if any(part.endswith("flower-supernode") for part in cmd) and "--node-config" in cmd:
            config = cmd[cmd.index("--node-config") + 1]
            found[int(config.split()[0].split("=")[1])] = proc
    return found


def _kill_node(node: psutil.Process) -> list[int]:
    """SIGKILL a SuperNode, its children and the ClientApp processes attached to its port."""
    cmd = node.cmdline()
    address = f"127.0.0.1:{cmd[cmd.index('--port') + 1]}" if "--port" in cmd else None
    victims = [node, *node.children(recursive=True)]
    if address is not None:
        for proc in psutil.process_iter(["cmdline"]):
            if address in " ".join(proc.info.get("cmdline") or []) and proc.pid != node.pid:
                victims.append(proc)
    killed = []
    for proc in victims:
        try:
            proc.send_signal(signal.SIGKILL)
            killed.append(proc.pid)
        except psutil.Error:
            pass
    return killed


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / "summary.json"
    argv = [
        *CLI, "federated", "--model", f"{DIGITS}:make_model", "--dataset", f"{DIGITS}:train_set",
        "--val-dataset", f"{DIGITS}:test_set", "--partition", "iid", "--clients", str(args.clients),
        "--rounds", "1", "--local-steps", "10", "--batch-size", "16", "--lr", "0.1",
        "--run-dir", str(tmp / "run"), "--resume", "never", "--summary-json", str(out), "--secagg",
    ]  # fmt: skip
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    lines: list[str] = []
    killed: dict[int, list[int]] = {}
    trigger = f"secagg {args.kill_after}:"
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        print(line.rstrip(), flush=True)
        if args.kill and not killed and trigger in line:
            nodes = _supernodes(psutil.Process(proc.pid))
            for pid in sorted(nodes)[-args.kill:]:
                killed[pid] = _kill_node(nodes[pid])
            print(f"bench: SIGKILLed SuperNodes of partitions {sorted(killed)} after {args.kill_after}",
                  flush=True)
    code = proc.wait()
    done.set()
    wall = time.monotonic() - started
    if args.kill and not killed:
        raise RuntimeError(f"the run never said {trigger!r}: nothing was killed\n" + "\n".join(lines[-40:]))
    if code != 0 or not out.exists():
        raise RuntimeError(f"the run failed (exit {code})\n" + "\n".join(lines[-60:]))
    row = json.loads(out.read_text())["rounds"][0]
    secagg = row.get("secagg", {})
    return {
        "completed": not row["failed"],
        "sampled": row["sampled"],
        "answered": row["answered"],
        "dropped": row["dropped"],
        "killed_partitions": sorted(killed),
        "kill_after": args.kill_after,
        "round_s": row["seconds"],
        "stage_seconds": secagg.get("stage_seconds"),
        "startup_seconds": secagg.get("startup_seconds"),
        "failed_stage": secagg.get("failed_stage"),
        "accuracy": row.get("accuracy"),
        "wall_s": wall,
        "load_1min": {"min": min(loads, default=0.0), "median": statistics.median(loads) if loads else 0.0,
                      "max": max(loads, default=0.0)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--kill", type=int, default=2, help="SuperNodes to SIGKILL mid-protocol")
    parser.add_argument("--kill-after", choices=STAGES, default="share_keys",
                        help="the stage after which they are killed")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if not 0 <= args.kill < args.clients:
        parser.error(f"--kill must be in [0, --clients), got {args.kill}")
    with tempfile.TemporaryDirectory(prefix="fl-secagg-kill-") as tmp:
        result = run(args, Path(tmp))
    load = result["load_1min"]
    print(f"{args.clients} clients, {args.kill} SIGKILLed after {args.kill_after}: "
          f"{'completed' if result['completed'] else 'FAILED'} with {result['answered']} of {result['sampled']} "
          f"in {result['round_s']:.1f} s (start-up {result['startup_seconds']:.1f} s; load "
          f"{load['min']:.1f}-{load['max']:.1f}, median {load['median']:.1f})")
    print("stage seconds:", {k: round(v, 1) for k, v in (result["stage_seconds"] or {}).items()})
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
                "cpus": os.cpu_count(), **{k: v for k, v in vars(args).items() if k != "json"}}
        Path(args.json).write_text(json.dumps({"meta": meta, "result": result}, indent=2))
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
