"""Load test of ``torsh-dist serve``: requests/s, p50/p99 latency and tokens/s at concurrency
1, 4 and 16 on loopback, with batching off (``--max-batch-size 1``) and on, side by side.

The server runs as its own process (the real CLI), so the client threads here do not compete
with it for the GIL. Each client sends its share of a fixed number of requests back to back
(fresh prompts, seeded sampling, ``max_new_tokens`` fixed so every request costs the same);
latency is the client's wall time per request. The mean batch size comes from the server's
``/metrics``. Both servers run at once and the measurements alternate between them, ``--rounds``
times; the table shows the median of the rounds. Without ``--checkpoint`` a tiny checkpoint is
trained first::

    .venv/bin/python benchmarks/bench_serve.py --requests 48 --max-new-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import http.client
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
from pathlib import Path

from torsh_distributed.testing import find_free_port

CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
WORDS = ["def", "import", "class", "return", "for", "while", "with", "yield", "self", "print"]


def _train(root: Path, steps: int) -> str:
    out = root / "ckpt"
    subprocess.run(
        [
            *CLI,
            "train",
            "--preset",
            "tiny",
            "--max-steps",
            str(steps),
            "--checkpoint-dir",
            str(out),
            "--progress",
            "false",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return str(out)


class Server:
    """``torsh-dist serve`` on a free loopback port until :meth:`stop`."""

    def __init__(self, checkpoint: str, max_batch_size: int, wait_ms: float, log: Path) -> None:
        self.port = find_free_port()
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [
                *CLI,
                "serve",
                "--checkpoint",
                checkpoint,
                "--port",
                str(self.port),
                "--max-batch-size",
                str(max_batch_size),
                "--batch-wait-ms",
                str(wait_ms),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while "listening on" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.1)

    def get(self, path: str) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("GET", path)
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def post(self, body: dict) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body))
            resp = conn.getresponse()
            data = json.loads(resp.read())
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data}")
            return data
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _load(server: Server, *, concurrency: int, requests: int, new_tokens: int) -> dict[str, float]:
    before = server.get("/metrics")
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(index: int) -> None:
        for i in range(index, requests, concurrency):
            prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 5))
            body = {
                "prompt": prompt,
                "max_new_tokens": new_tokens,
                "temperature": 0.8,
                "seed": i,
                "top_k": 40,
            }
            t0 = time.perf_counter()
            data = server.post(body)
            took = time.perf_counter() - t0
            with lock:
                latencies.append(took)
                tokens[0] += len(data["tokens"])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = server.get("/metrics")
    batches = _metric(after, "torsh_serve_batch_size_count") - _metric(
        before, "torsh_serve_batch_size_count"
    )
    latencies.sort()
    return {
        "requests_per_s": requests / wall,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))] * 1e3,
        "tokens_per_s": tokens[0] / wall,
        "mean_batch": requests / batches if batches else float("nan"),
    }


def _median_row(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a checkpoint to serve (default: train a tiny one)")
    parser.add_argument("--train-steps", type=int, default=50)
    parser.add_argument("--requests", type=int, default=48, help="requests per measurement")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions (median)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="the batching-on server")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    labels = {1: "off (batch 1)", args.max_batch_size: f"on (batch <= {args.max_batch_size})"}
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp)
        checkpoint = args.checkpoint or _train(root, args.train_steps)
        # both servers up at once; measurements alternate off/on so machine drift hits both
        servers = {
            batch: Server(checkpoint, batch, args.batch_wait_ms, root / f"serve-{batch}.log")
            for batch in labels
        }
        try:
            for server in servers.values():
                server.post({"prompt": "warm up", "max_new_tokens": 4})
            for round_ in range(args.rounds):
                for c in levels:
                    order = list(servers.items())
                    for batch, server in order if round_ % 2 == 0 else order[::-1]:
                        r = _load(
                            server,
                            concurrency=c,
                            requests=args.requests,
                            new_tokens=args.max_new_tokens,
                        )
                        runs.setdefault((labels[batch], c), []).append(r)
                        print(
                            f"round {round_} batching {labels[batch]:>18} concurrency {c:>3}: "
                            f"{r['requests_per_s']:6.2f} req/s  p50 {r['p50_ms']:7.1f} ms  "
                            f"p99 {r['p99_ms']:7.1f} ms  {r['tokens_per_s']:7.1f} tok/s  "
                            f"mean batch {r['mean_batch']:.2f}",
                            flush=True,
                        )
        finally:
            for server in servers.values():
                server.stop()
    rows = [
        {"batching": label, "concurrency": c, **_median_row(runs[(label, c)])}
        for label in labels.values()
        for c in levels
    ]
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; {args.requests} requests x {args.max_new_tokens} new "
        f"tokens per measurement; median of {args.rounds} interleaved rounds\n"
    )
    print(
        "| batching | concurrency | requests/s | p50 latency (ms) | p99 latency (ms) | tokens/s "
        "| mean batch | tokens/s vs batching off |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["batching"] == labels[1]}
    for r in rows:
        print(
            f"| {r['batching']} | {r['concurrency']} | {r['requests_per_s']:.2f} | "
            f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['tokens_per_s']:.0f} | "
            f"{r['mean_batch']:.2f} | {r['tokens_per_s'] / base[r['concurrency']]:.2f}x |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
