"""Federated rounds over slow links: round time and bytes with and without compressed updates.

Hosts are network namespaces (benchmarks/netlab): host 0 runs ``torsh-dist federated
--remote-nodes`` (the SuperLink behind the token relay), hosts 1..C each run ``torsh-dist
federated-node``; every host's link is shaped to ``--rate-mbit`` (10 Mbit by default) each way,
so the server's link carries C copies of the model down and C updates up per round. The model is
``examples/federated_digits.py:make_wide_model`` (1.13 M parameters, 4.5 MB in fp32) on the
digits, IID, FedAvg; every compression method runs the same rounds in the same invocation, one
after the other. Reported per method: mean round time (rounds 2.., so process start-up of round 1
is left out), bytes up per round (what the clients sent), bytes down, and the server's accuracy
after the last round, and the bytes that crossed the head's link (its eth0 counters, both ways,
handshakes and start-up included).

``--security insecure,tls`` runs every method both ways (the relays in the clear after the token
handshake, or mutual TLS with the CA the head makes), ``--repeats N`` alternates them N times:
the TLS overhead, paired.

    sudo .venv/bin/python benchmarks/bench_federated_netlab.py --json fl_net.json
    .venv/bin/python benchmarks/bench_federated_netlab.py --methods none,topk:0.01 --rounds 3
    .venv/bin/python benchmarks/bench_federated_netlab.py --methods none --security insecure,tls --repeats 2
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


def _link_bytes(lab: NetLab, host: int) -> int:
    """Bytes received plus sent on ``host``'s eth0 so far."""
    stats = "/sys/class/net/eth0/statistics"
    out = lab.run(host, ["cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"]).stdout.split()
    return sum(int(v) for v in out)


def run_method(
    lab: NetLab, method: str, *, clients: int, rounds: int, out: Path, port: int, security: str = "insecure"
) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", TOKEN_ENV: "bench-token-" + "x" * 16}
    head = lab.address(0)
    tag = f"{method.replace(':', '_')}_{security}_{port}"
    summary_path = out / f"{tag}.json"
    run_dir = out / f"run_{tag}"
    wire_before = _link_bytes(lab, 0)
    argv = [
        *CLI, "federated", "--model", f"{DIGITS}:make_wide_model", "--dataset", f"{DIGITS}:train_set",
        "--val-dataset", f"{DIGITS}:test_set", "--partition", "iid", "--clients", str(clients),
        "--min-clients", str(clients), "--rounds", str(rounds), "--local-steps", "5", "--batch-size", "32",
        "--lr", "0.05", "--compression", method, "--run-dir", str(run_dir),
        "--resume", "never", "--superlink-host", head, "--superlink-port", str(port), "--remote-nodes",
        "--token-env", TOKEN_ENV, "--summary-json", str(summary_path), "--timeout", "1200",
        *(["--insecure"] if security == "insecure" else []),
    ]  # fmt: skip
    started = time.monotonic()
    server = lab.popen(0, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pki = run_dir / "tls"
    while security == "tls" and not (pki / f"node-{clients - 1}.key").exists():  # the head's CA first
        if server.poll() is not None or time.monotonic() - started > 120:
            raise RuntimeError(f"{method}: no certificates from the head\n{server.communicate()[0].decode()[-2000:]}")
        time.sleep(0.1)

    def node_flags(pid: int) -> list[str]:
        if security == "insecure":
            return ["--insecure"]
        return ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / f"node-{pid}.pem"),
                "--tls-key", str(pki / f"node-{pid}.key")]  # fmt: skip

    nodes = [
        lab.popen(
            host,
            [*CLI, "federated-node", "--superlink", f"{head}:{port}", "--partition-id", str(host - 1),
             "--num-partitions", str(clients), "--token-env", TOKEN_ENV, *node_flags(host - 1)],
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
        "security": security,
        "wire_bytes": _link_bytes(lab, 0) - wire_before,
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
    parser.add_argument("--security", default="insecure",
                        help="comma-separated: insecure (token only) and/or tls (mutual TLS), each run per method")
    parser.add_argument("--repeats", type=int, default=1, help="alternate the security modes this many times")
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
        runs = [(m, sec) for _ in range(args.repeats) for m in methods for sec in args.security.split(",")]
        for i, (method, security) in enumerate(runs):
            results.append(run_method(lab, method, clients=args.clients, rounds=args.rounds, out=Path(tmp),
                                      port=29800 + i, security=security))  # fmt: skip
            r = results[-1]
            print(f"{method:>12} {security:>8}: round {r['round_s']:.1f} s, up {r['up_bytes'] / 1e6:.2f} MB, "
                  f"down {r['down_bytes'] / 1e6:.2f} MB, on the head's link {r['wire_bytes'] / 1e6:.2f} MB, "
                  f"wall {r['wall_s']:.1f} s, acc {r['accuracy']}", flush=True)
    if "," in args.security:  # the paired comparison: each mode against the first, run by run
        first = args.security.split(",")[0]
        for r in results:
            if r["security"] != first:
                ref = next(x for x in reversed(results[: results.index(r)]) if x["security"] == first
                           and x["method"] == r["method"])  # fmt: skip
                print(f"{r['method']} {r['security']} vs {first}: round time {r['round_s'] / ref['round_s']:.3f}x, "
                      f"bytes on the link {r['wire_bytes'] / ref['wire_bytes']:.3f}x, loss "
                      f"{r['loss']:.6f} vs {ref['loss']:.6f}")
    base = results[0]
    print(f"\n{args.clients} clients, {args.rate_mbit:g} Mbit per host link, {args.rounds} rounds; round time "
          "of rounds 2.. (mean)")
    print(f"{'method':>12} | {'security':>8} | {'round s':>8} | {'vs first':>8} | {'up MB/round':>11} | "
          f"{'up vs first':>11} | {'down MB/round':>13} | {'accuracy':>8}")
    for r in results:
        print(f"{r['method']:>12} | {r['security']:>8} | {r['round_s']:8.1f} | {base['round_s'] / r['round_s']:7.2f}x | "
              f"{r['up_bytes'] / 1e6:11.2f} | {base['up_bytes'] / r['up_bytes']:10.1f}x | "
              f"{r['down_bytes'] / 1e6:13.2f} | {r['accuracy'] if r['accuracy'] is None else round(r['accuracy'], 3)!s:>8}")
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
                "cpus": os.cpu_count(), "rate_mbit": args.rate_mbit, "clients": args.clients, "rounds": args.rounds}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
