"""How evenly this machine's cores run the same work side by side (the pipeline bubble's noise floor).

The pipeline-bubble theory assumes equal stages. Two ranks of a pipeline on one machine run the same
stage code on different cores; whatever makes one core slower than the other for a while is
imbalance, and a rank waiting for the slower one counts it as bubble. This runs the same
single-thread matmul loop pinned to each core, first both at once, then each alone, and prints
the seconds per window and the slower/faster ratio of each simultaneous window.

    python benchmarks/bench_core_balance.py --windows 5 --matmuls 1500

A 10 % band around a bubble of (p-1)/(m+p-1) = 0.11 (p = 2, m = 8) is about 1 % of the step time:
two cores that differ by more than that per step cannot resolve it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _work(core: int, windows: int, matmuls: int, start: object, out: object) -> None:
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(20):
        a @ b
    start.wait()  # type: ignore[attr-defined]
    times = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(matmuls):
            a @ b
        times.append(time.perf_counter() - t0)
    out.put((core, times))  # type: ignore[attr-defined]


def _run(cores: list[int], windows: int, matmuls: int) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(cores)), ctx.Queue()
    procs = [ctx.Process(target=_work, args=(c, windows, matmuls, start, out)) for c in cores]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--matmuls", type=int, default=1500, help="512x512 matmuls per window")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    both = _run(cores, args.windows, args.matmuls)
    alone = {c: _run([c], args.windows, args.matmuls)[c] for c in cores}
    print(f"cores {cores}, {args.matmuls} matmuls (512x512, 1 thread) per window\n")
    a, b = cores
    print(f"| window | both: core {a} s | both: core {b} s | slower/faster "
          f"| alone: core {a} s | alone: core {b} s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i in range(args.windows):
        x, y = both[cores[0]][i], both[cores[1]][i]
        print(f"| {i} | {x:.3f} | {y:.3f} | {max(x, y) / min(x, y):.3f} | "
              f"{alone[cores[0]][i]:.3f} | {alone[cores[1]][i]:.3f} |")


if __name__ == "__main__":
    main()
