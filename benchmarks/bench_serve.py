"""Load test of ``torsh-dist serve``: continuous vs static batching under Poisson arrivals, side by
side in one run, with vLLM's serving metrics (throughput, TTFT, TPOT at p50/p99).

Two servers run at once (the real CLI, each its own process): ``--scheduler continuous`` and
``--scheduler static``, the same checkpoint, ``--max-batch-size`` and limits. For each arrival
rate the benchmark sends the same ``--requests`` requests to each server in turn (order flipped
every rate): arrival times drawn from a Poisson process (exponential gaps, seeded), prompts and
``max_tokens`` of mixed lengths (uniform in the given ranges, seeded), seeded sampling without
stop strings so every request generates exactly its ``max_tokens``. Clients stream
(``"stream": true``) through one asyncio event loop in this process:

* TTFT: arrival to the first token's chunk; TPOT: (last token - first token) / (tokens - 1);
* throughput: output tokens / (last answer - first arrival); request rate achieved likewise.

Bounded: ``--requests`` per rate and server, each request ``--timeout`` seconds at most.
Without ``--checkpoint`` a tiny checkpoint is trained first::

    .venv/bin/python benchmarks/bench_serve.py --rates 10,40,80 --requests 80
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from torsh_distributed.testing import find_free_port

CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
SOURCE = (Path(__file__).resolve().parents[1] / "src/torsh_distributed/inference/server.py")


def _train(root: Path, steps: int, block: int) -> str:
    out = root / "ckpt"
    subprocess.run(
        [*CLI, "train", "--preset", "tiny", "--model.block-size", str(block), "--max-steps",
         str(steps), "--checkpoint-dir", str(out), "--progress", "false"],
        check=True, capture_output=True, timeout=900,
    )
    return str(out)


class Server:
    """``torsh-dist serve`` on a free loopback port until :meth:`stop`."""

    def __init__(self, checkpoint: str, scheduler: str, args: argparse.Namespace, log: Path):
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [*CLI, "serve", "--checkpoint", checkpoint, "--port", str(self.port), "--scheduler",
             scheduler, "--max-batch-size", str(args.max_batch_size), "--batch-wait-ms",
             str(args.batch_wait_ms), "--max-new-tokens-limit", "1024"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while "listening on" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@dataclass(frozen=True, slots=True)
class Job:
    at: float
    prompt: str
    max_tokens: int
    seed: int


def workload(rate: float, count: int, args: argparse.Namespace, seed: int) -> list[Job]:
    rng = random.Random(seed)
    text = SOURCE.read_text()
    jobs, t = [], 0.0
    for i in range(count):
        t += rng.expovariate(rate)
        length = rng.randint(*args.prompt_len)
        start = rng.randrange(len(text) - length)
        jobs.append(Job(at=t, prompt=text[start : start + length], seed=i,
                        max_tokens=rng.randint(*args.output_len)))
    return jobs


async def _one(client: httpx.AsyncClient, url: str, job: Job, t0: float, timeout: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
    arrived = time.perf_counter()
    body = {"model": None, "prompt": job.prompt, "max_tokens": job.max_tokens,
            "temperature": 0.8, "top_k": 40, "seed": job.seed, "stream": True,
            "return_token_ids": True}
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            times.extend([time.perf_counter()] * len(ids))
    assert len(times) == job.max_tokens, (len(times), job.max_tokens)
    return {"arrived": arrived, "first": times[0], "last": times[-1], "tokens": len(times)}


async def _run(url: str, jobs: list[Job], timeout: float) -> list[dict]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter() + 0.05
        return await asyncio.gather(*(_one(client, url, j, t0, timeout) for j in jobs))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(results: list[dict]) -> dict[str, float]:
    start = min(r["arrived"] for r in results)
    end = max(r["last"] for r in results)
    ttft = [r["first"] - r["arrived"] for r in results]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {
        "req_per_s": len(results) / (end - start),
        "tok_per_s": sum(r["tokens"] for r in results) / (end - start),
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p99_ms": _pct(ttft, 0.99) * 1e3,
        "tpot_p50_ms": statistics.median(tpot) * 1e3,
        "tpot_p99_ms": _pct(tpot, 0.99) * 1e3,
    }


def _range(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split("-"))
    return low, high


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a checkpoint to serve (default: train a tiny one)")
    parser.add_argument("--train-steps", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=256, help="context of the trained one")
    parser.add_argument("--rates", default="10,40,80", help="arrival rates, requests/s")
    parser.add_argument("--requests", type=int, default=80, help="requests per rate and server")
    parser.add_argument("--prompt-len", type=_range, default=(8, 96), metavar="LO-HI")
    parser.add_argument("--output-len", type=_range, default=(8, 128), metavar="LO-HI")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0, help="static's window")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp)
        checkpoint = args.checkpoint or _train(root, args.train_steps, args.block_size)
        servers = {s: Server(checkpoint, s, args, root / f"{s}.log")
                   for s in ("static", "continuous")}
        try:
            for server in servers.values():  # warm up
                asyncio.run(_run(server.url, workload(50, 4, args, seed=99), args.timeout))
            for k, rate in enumerate(rates):
                jobs = workload(rate, args.requests, args, seed=k)
                order = list(servers.items())
                for name, server in order if k % 2 == 0 else order[::-1]:
                    row = {"scheduler": name, "rate": rate,
                           **summarize(asyncio.run(_run(server.url, jobs, args.timeout)))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; {args.requests} requests per rate, prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]} bytes, outputs "
        f"{args.output_len[0]}-{args.output_len[1]} tokens, max batch {args.max_batch_size}\n"
    )
    print("| rate (req/s) | scheduler | achieved req/s | output tok/s | TTFT p50 (ms) | "
          "TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | tok/s vs static |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    static = {r["rate"]: r["tok_per_s"] for r in rows if r["scheduler"] == "static"}
    for r in sorted(rows, key=lambda r: (r["rate"], r["scheduler"] != "static")):
        print(f"| {r['rate']:g} | {r['scheduler']} | {r['req_per_s']:.1f} | {r['tok_per_s']:.0f} "
              f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | "
              f"{r['tpot_p99_ms']:.1f} | {r['tok_per_s'] / static[r['rate']]:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
