"""All-reduce bus bandwidth of the ``gloo+shm`` backend against plain Gloo, side by side in one run.

Usage::

    python benchmarks/bench_shm.py --ranks 2,4 --sizes 1K,64K,1M,32M,256M --json out.json

For each world size, the ranks start on ``gloo+shm`` and also open a plain Gloo group over the
same ranks; every size is measured on both, call by call in a fresh random order per iteration
(the same on every rank), each call timed from a barrier; a call lasts as long as its slowest
rank; the median is kept. ``busbw = size / time * 2 (n - 1) / n`` (nccl-tests). In the same run,
after each size's calls (the other ranks waiting in a barrier), rank 0 measures the single-thread
memory-copy bound at that size: ``dst.copy_(src)`` of two float32 tensors of the size,
``torch.set_num_threads(1)``, bytes copied per second of the fastest copy (a bound: on a
loaded machine the median would flatter the collectives). Then every rank copies at the same
time (the slowest rank's best copy): a rank's share of the node's memory bandwidth while its
peers use theirs, which is what a collective's ranks get (on the 2-core VM two copies at once
get about half each). Prints a Markdown table with the load average beside it; ranks run with
``OMP_NUM_THREADS=1``.

``--burners-per-core B`` starts ``B x cores`` CPU-burning processes (a busy loop each, the
neighbours of a busy host) before the ranks and stops them after; ``--rounds R`` repeats every
world size R times (a row per round)::

    python benchmarks/bench_shm.py --ranks 2 --sizes 32M --burners-per-core 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import _burners  # noqa: E402

from torsh_distributed.cli.bench import parse_size  # noqa: E402
from torsh_distributed.testing import run_distributed  # noqa: E402


def _memcpy_bound(nbytes: int, repeats: int) -> float:
    torch.set_num_threads(1)
    src = torch.ones(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() * 4 / min(times)  # the bound: the best copy this core managed


def _iters(nbytes: int) -> int:
    return int(min(max((64 << 20) // max(nbytes, 1), 3), 40))


def _rank_body(sizes: list[int], warmup: int) -> dict:
    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    groups = {"gloo+shm": None, "gloo": gloo}
    rows = []
    for size in sizes:
        count = max(size // 4, 1)
        buf = torch.ones(count)
        for g in groups.values():
            for _ in range(warmup):
                dist.all_reduce(buf, group=g)
        durations: dict[str, list[float]] = {k: [] for k in groups}
        shuffler = random.Random(size)
        for _ in range(_iters(size)):
            order = list(groups)
            shuffler.shuffle(order)
            for name in order:
                dist.barrier(group=groups[name])
                t0 = time.perf_counter()
                dist.all_reduce(buf, group=groups[name])
                durations[name].append(time.perf_counter() - t0)
        mine = torch.tensor([durations[k] for k in groups], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(every, mine, group=gloo)
        slowest = torch.stack(every).amax(dim=0)
        dist.barrier(group=gloo)
        memcpy = _memcpy_bound(size, max(_iters(size), 5)) if rank == 0 else 0.0
        dist.barrier(group=gloo)
        # every rank copying at once: what each gets of the node's shared memory bandwidth
        together = torch.tensor([_memcpy_bound(size, max(_iters(size), 5))])
        dist.all_reduce(together, op=dist.ReduceOp.MIN, group=gloo)
        for name, calls in zip(groups, slowest.tolist(), strict=True):
            t = statistics.median(calls)
            rows.append(
                {
                    "impl": name,
                    "ranks": n,
                    "size": count * 4,
                    "time_us": t * 1e6,
                    "busbw_GBps": count * 4 / t * 2 * (n - 1) / n / 1e9,
                    "calls": len(calls),
                    "memcpy_GBps": memcpy / 1e9,
                    "memcpy_together_GBps": together.item() / 1e9,
                }
            )
    return {"rows": rows}


def _table(results: dict[int, list[dict]]) -> str:
    lines = [
        "| ranks | size (B) | Gloo busbw (GB/s) | shm busbw (GB/s) | shm / Gloo "
        "| memcpy 1 thread (GB/s) | shm / memcpy | memcpy, all ranks at once (GB/s) "
        "| shm / that |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, res in ((n, res) for n, rounds in results.items() for res in rounds):
        by = {(r["impl"], r["size"]): r for r in res["rows"]}
        for size in sorted({r["size"] for r in res["rows"]}):
            g, s = by[("gloo", size)], by[("gloo+shm", size)]
            lines.append(
                f"| {n} | {size} | {g['busbw_GBps']:.3f} | {s['busbw_GBps']:.3f} | "
                f"{s['busbw_GBps'] / g['busbw_GBps']:.2f} | {s['memcpy_GBps']:.2f} | "
                f"{s['busbw_GBps'] / s['memcpy_GBps']:.2f} | {s['memcpy_together_GBps']:.2f} | "
                f"{s['busbw_GBps'] / s['memcpy_together_GBps']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma list of world sizes")
    parser.add_argument("--sizes", default="1K,64K,1M,32M,256M", help="comma list of sizes")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size and impl")
    parser.add_argument("--json", default="", help="write the results to this file")
    _burners.add_argument(parser)
    parser.add_argument("--rounds", type=int, default=1, help="repeat every world size")
    args = parser.parse_args(argv)
    if args.burners_per_core < 0 or args.rounds < 1:
        parser.error("--burners-per-core must be >= 0 and --rounds >= 1")
    try:
        ranks = [int(x) for x in args.ranks.split(",")]
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if any(r < 2 for r in ranks):
        parser.error("--ranks: world sizes must be >= 2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[int, list[dict]] = {}
    with _burners.burning(args.burners_per_core) as burners:
        load_before = os.getloadavg()
        for _ in range(args.rounds):
            for n in ranks:
                out = run_distributed(
                    _rank_body,
                    n,
                    args=(sizes, args.warmup),
                    backend="gloo+shm",
                    timeout=900,
                    env={"OMP_NUM_THREADS": "1"},
                )
                results.setdefault(n, []).append(out[0])
    load_after = os.getloadavg()
    print(f"{burners} burner process(es) beside the ranks")
    print(_table(results))
    print(
        f"load average (1/5/15 min) before: {load_before}, after: {load_after}; "
        f"cores: {os.cpu_count()}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": results, "load": [load_before, load_after]}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
