"""Per-call cost of the collectives facade over raw torch.distributed (world of one, Gloo).

A world of one makes the collective itself nearly free, so the difference is the facade's own
Python work (op parsing, dtype checks, algorithm resolution, profiler/debug checks when off).
Raw and facade calls are measured in alternating rounds; the best round of each is kept::

    .venv/bin/python benchmarks/bench_facade_overhead.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import torsh_distributed as tdist
from torsh_distributed.comm import collectives as C


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(rounds: int = 15, calls: int = 5000) -> None:
    tdist.init(backend="gloo", rank=0, world_size=1)
    t = torch.ones(1)
    cases = {
        "all_reduce": (lambda: dist.all_reduce(t), lambda: C.all_reduce(t)),
        "broadcast": (lambda: dist.broadcast(t, 0), lambda: C.broadcast(t, 0)),
        "all_gather_into_tensor": (
            lambda: dist.all_gather_into_tensor(t, t),
            lambda: C.all_gather_into_tensor(t, t),
        ),
    }
    print("| op | raw torch (us/call) | facade (us/call) | overhead (us/call) |")
    print("|---|---:|---:|---:|")
    for name, (raw, facade) in cases.items():
        best_raw = best_facade = float("inf")
        for fn in (raw, facade):
            _per_call_us(fn, 500)  # warm up
        for _ in range(rounds):
            best_raw = min(best_raw, _per_call_us(raw, calls))
            best_facade = min(best_facade, _per_call_us(facade, calls))
        print(f"| {name} | {best_raw:.2f} | {best_facade:.2f} | {best_facade - best_raw:.2f} |")
    tdist.shutdown()


if __name__ == "__main__":
    main()
