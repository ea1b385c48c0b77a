"""Benchmark scripts still run: each in its quick smoke mode, as a user would start it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_bench_inference_smoke() -> None:
    out = _run("bench_inference.py", "--smoke")
    for variant in ("TP=1", "TP=1, 2 threads", "TP=2", "TP=1 no cache"):
        assert f"| {variant} |" in out, out
    assert "| variant | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |" in out, out
    assert "TP=2 tokens == TP=1 tokens (batch 1 and every batch): True" in out, out
    assert "TP=1 no-cache tokens == TP=1 cached tokens (batch 1): True" in out, out
    assert "every TP rank returned the same tokens: True" in out, out


def test_bench_federated_check() -> None:
    # a real run (SuperLink, SuperNodes, a ClientApp process per client-round) takes ~30 s even
    # with 2 clients and 1 round: this checks that every run's flags still parse into the intended
    # config with the current CLI, and that a seed giving every Dirichlet client a batch is found
    out = _run("bench_federated.py", "--check", timeout=60)
    assert "Dirichlet(0.1) client sizes" in out, out
    for line in (
        "check iid-vs-dirichlet: FedAvg, IID: strategy fedavg, partition iid,",
        "check iid-vs-dirichlet: FedAvg, Dirichlet(0.1): strategy fedavg, partition dirichlet, alpha 0.1,",
        "check stragglers: FedAvg, drop stragglers: strategy fedavg, partition dirichlet, alpha 0.1,",
        "check stragglers: FedProx mu=0.01, keep: strategy fedprox, partition dirichlet, alpha 0.1,",
        "check stragglers: FedAdam eta=0.1, keep: strategy fedadam, partition dirichlet, alpha 0.1,",
        "check corpus: built-in corpus by package: strategy fedavg, partition package,",
    ):
        assert line in out, out
    assert out.count("stragglers 0.3 (drop)") == 1 and out.count("stragglers 0.3 (keep)") == 2, out
