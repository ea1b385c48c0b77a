"""``torsh-dist bench collectives``: nccl-tests-style bandwidth table of raw torch vs our facade.

Launches itself on ``--nproc`` local ranks through :func:`torsh_distributed.elastic.launch.launch`
(like ``torsh-dist train``); each rank runs :func:`run_bench`. Per op, size and implementation the
table shows size, element count, dtype, time (the median over calls of the slowest rank's
duration), ``algbw = size / time`` and ``busbw = algbw * factor`` with nccl-tests' factors
(all-reduce ``2 (n - 1) / n``, all-gather, reduce-scatter and all-to-all ``(n - 1) / n``, broadcast
and reduce ``1``). Implementations are run interleaved call by call in a fresh random order per
iteration (the same on every rank), on the same buffers, each timed from a barrier; the median
call is kept, so every implementation sees the same machine noise and bursts do not count. ``vs torch`` is the busbw ratio of those medians; ``paired`` is the median over iterations
of ``t_torch / t_impl`` for the calls of one iteration (made back to back), the estimate that
machine load drifting during the run disturbs least.

Implementations: ``torch`` (raw ``torch.distributed``), ``torch2`` (raw torch again: an A/A
control whose ratio to ``torch`` is the noise floor of the measurement on this machine), ``torsh``
(the facade, backend's algorithm, called as a user would: without the ``algorithm`` argument),
``ring``, ``tree``, ``hierarchical`` (facade with that algorithm; only ops that have it) and
``auto`` (facade, cost model after a link probe; the JSON names the algorithm it chose) and
``shm`` (raw ``torch.distributed`` on a ``gloo+shm`` group over the same ranks: shared memory
inside the node, see docs/shm.md; all-to-all and reduce fall back to Gloo inside it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["register", "parse_size", "run_bench", "main", "OPS", "IMPLS"]

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all")
IMPLS = ("torch", "torch2", "torsh", "ring", "tree", "hierarchical", "auto", "shm")
_ALGO_OPS = {
    "ring": {"all_reduce"},
    "tree": {"all_reduce", "broadcast", "reduce"},
    "hierarchical": {"all_reduce"},
    "auto": {"all_reduce", "broadcast", "reduce"},
}
_EPILOG = """\
examples:
  torsh-dist bench collectives --nproc 2 --ops all_reduce,all_gather --sizes 1M,16M --impl torch,torsh
  torsh-dist bench collectives --nproc 4 --sizes 1K,1M --impl torch,ring,tree,auto --json bench.json
  torsh-dist bench collectives --nproc 4 --ops all_reduce,all_gather --sizes 1M,32M --impl torch,shm
"""
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
}


def parse_size(text: str) -> int:
    """``"1K"`` -> 1024, ``"16M"`` -> 16 MiB, ``"100"`` -> 100 bytes."""
    t = text.strip().upper()
    num = t.rstrip("KMGB")
    unit = t[len(num) :]
    try:
        value = int(float(num) * _UNITS[unit])
    except (ValueError, KeyError):
        raise ValueError(f"size must look like 1K, 1M or 4096, got {text!r}") from None
    if value < 4:
        raise ValueError(f"size must be at least 4 bytes (one float32), got {text!r}")
    return value


def _csv(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{what} must be a comma list of {', '.join(allowed)}; got {text!r}")
    return items


def _bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", default="all_reduce", help=f"comma list of {', '.join(OPS)}")
    parser.add_argument(
        "--sizes", default="1K,1M,16M", help="comma list of buffer sizes (1K, 1M, ...)"
    )
    parser.add_argument(
        "--impl",
        default="torch,torsh",
        help=f"comma list of {', '.join(IMPLS)} (shm: a gloo+shm group, shared memory in the node)",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per impl per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="calls per impl = rounds x iters (interleaved, each after a barrier)",
    )
    parser.add_argument("--json", default="", help="write every row to this JSON file (rank 0)")


def _op_call(op: str, impl: str, buf: Any, out: Any, n: int, shm: Any = None) -> Any:
    import torch.distributed as dist

    from torsh_distributed.comm import collectives as C

    if impl == "shm":  # raw torch on the gloo+shm group
        return _raw_call(op, buf, out, shm)
    raw = impl in ("torch", "torch2")
    algo = "torch" if impl in ("torch", "torch2", "torsh") else impl
    kw = {} if algo == "torch" else {"algorithm": algo}  # torsh: called as a user would
    if op == "all_reduce":
        return (lambda: dist.all_reduce(buf)) if raw else (lambda: C.all_reduce(buf, **kw))
    if op == "broadcast":
        return (lambda: dist.broadcast(buf, 0)) if raw else (lambda: C.broadcast(buf, 0, **kw))
    if op == "reduce":
        return (lambda: dist.reduce(buf, 0)) if raw else (lambda: C.reduce(buf, 0, **kw))
    if op == "all_gather":
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: fn(out, buf)) if raw else (lambda: C.all_gather_into_tensor(out, buf))
    if op == "reduce_scatter":
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: fn(buf, out)) if raw else (lambda: C.reduce_scatter_tensor(buf, out))
    return (
        (lambda: dist.all_to_all_single(out, buf))
        if raw
        else (lambda: C.all_to_all_single(out, buf))
    )


def _raw_call(op: str, buf: Any, out: Any, group: Any) -> Any:
    import torch.distributed as dist

    if op == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(buf, dist.get_global_rank(group, 0), group=group)
    if op == "reduce":
        return lambda: dist.reduce(buf, dist.get_global_rank(group, 0), group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, buf, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(buf, out, group=group)
    return lambda: dist.all_to_all_single(out, buf, group=group)


def run_bench(
    *, ops: list[str], sizes: list[int], impls: list[str], iters: int, warmup: int, rounds: int
) -> list[dict[str, Any]]:
    """Measure on this rank (collective: every rank calls it); returns the rows on every rank."""
    import torch
    import torch.distributed as dist

    from torsh_distributed.comm import ParallelDims
    from torsh_distributed.comm import collectives as C
    from torsh_distributed.comm.profiler import busbw_factor

    n, rows = dist.get_world_size(), []
    dims = ParallelDims(dp=-1).build()
    if "auto" in impls:
        dims.probe()
    shm = None
    if "shm" in impls:
        from torsh_distributed.runtime.shm import register

        register()
        shm = dist.new_group(backend="gloo+shm")
    for op in ops:
        for size in sizes:
            count = size // 4
            # all_gather: size = total output (nccl-tests); reduce_scatter: size = total input
            per = max(count // n, 1) if op in ("all_gather", "reduce_scatter") else count
            if op == "all_to_all":
                per = count // n * n or n
            usable = [
                i for i in impls if i in ("torch", "torch2", "torsh", "shm") or op in _ALGO_OPS[i]
            ]
            if "hierarchical" in usable and not dims.hierarchical:
                usable.remove("hierarchical")
                if dist.get_rank() == 0 and op == ops[0] and size == sizes[0]:
                    print(
                        "note: impl 'hierarchical' skipped: one node (or uneven nodes); declare "
                        "simulated hosts with TORSH_NODE_ASSIGNMENT=0,0,1,1",
                        flush=True,
                    )
            # One pair of buffers for every impl: with buffers of their own, where the allocator
            # happened to place each one moved a row's ratio by up to +-5 % between runs (A/A too).
            buf = torch.ones(per)
            out = torch.ones(per * n if op in ("all_gather", "reduce_scatter") else per)
            calls = {}
            for impl in usable:
                calls[impl] = _op_call(op, impl, buf, out, n, shm)
                for _ in range(warmup):
                    calls[impl]()
            chosen = (
                {"auto": C.resolve_algorithm("auto", op, per * 4, None)} if "auto" in calls else {}
            )
            # Interleaved call by call, each call timed from a common start (barrier first, not
            # timed): machine noise hits every impl alike, no impl inherits the previous call's
            # rank skew, and the median ignores bursts.
            # The order is a fresh random permutation every iteration (the same on every rank: one
            # seeded generator), so no impl keeps a position or a predecessor; a fixed or
            # alternating order biased the 1 MB ratios by a few percent, A/A included.
            durations: dict[str, list[float]] = {i: [] for i in usable}
            shuffler = random.Random(len(usable) * 7919 + size)
            for _it in range(rounds * iters):
                order = list(usable)
                shuffler.shuffle(order)
                for impl in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    calls[impl]()
                    durations[impl].append(time.perf_counter() - t0)
            # A call lasts as long as its slowest rank: per call, the maximum over ranks.
            mine = torch.tensor([durations[i] for i in usable], dtype=torch.float64)
            every = [torch.empty_like(mine) for _ in range(n)]
            dist.all_gather(every, mine)
            calls_t = torch.stack(every).amax(dim=0)  # impl x call
            times = dict(zip(usable, calls_t.tolist(), strict=True))
            for impl in usable:
                nbytes = (per * n if op in ("all_gather", "reduce_scatter") else per) * 4
                t = statistics.median(times[impl])
                algbw = nbytes / t
                paired = (
                    statistics.median(
                        a / b for a, b in zip(times["torch"], times[impl], strict=True)
                    )
                    if "torch" in times
                    else None
                )
                rows.append(
                    {
                        "op": op,
                        "impl": impl,
                        "algorithm": chosen.get(impl, impl),
                        "size": nbytes,
                        "count": nbytes // 4,
                        "dtype": "float32",
                        "ranks": n,
                        "nodes": dims.num_nodes,
                        "time_us": t * 1e6,
                        "algbw_GBps": algbw / 1e9,
                        "busbw_GBps": algbw * busbw_factor(op, n) / 1e9,
                        "paired_vs_torch": paired,
                        "calls": len(times[impl]),
                    }
                )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of ``rows`` with the busbw ratio to ``torch`` of the same op and size."""
    ref = {(r["op"], r["size"]): r["busbw_GBps"] for r in rows if r["impl"] == "torch"}
    lines = [
        "| op | impl | algorithm | size (B) | count | dtype | time (us) | algbw (GB/s) | busbw (GB/s) "
        "| vs torch | paired |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = ref.get((r["op"], r["size"]))
        ratio = f"{r['busbw_GBps'] / base:.3f}" if base else "-"
        paired = r.get("paired_vs_torch")
        ratio += f" | {paired:.3f}" if paired is not None else " | -"
        lines.append(
            f"| {r['op']} | {r['impl']} | {r['algorithm']} | {r['size']} | {r['count']} | {r['dtype']} | "
            f"{r['time_us']:.1f} | {r['algbw_GBps']:.4f} | {r['busbw_GBps']:.4f} | {ratio} |"
        )
    return "\n".join(lines)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """What each launched rank runs: ``python -m torsh_distributed.cli.bench ...``."""
    parser = argparse.ArgumentParser(prog="python -m torsh_distributed.cli.bench")
    _bench_args(parser)
    args = parser.parse_args(argv)
    import torsh_distributed as tdist

    with tdist.init(backend="gloo") as rt:
        rows = run_bench(
            ops=_csv(args.ops, OPS, "--ops"),
            sizes=[parse_size(s) for s in args.sizes.split(",")],
            impls=_csv(args.impl, IMPLS, "--impl"),
            iters=args.iters,
            warmup=args.warmup,
            rounds=args.rounds,
        )
        if rt.is_main:
            print(format_table(rows), flush=True)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"rows": rows}, indent=2) + "\n")
        import torch.distributed as dist

        dist.barrier()  # leave together: a rank tearing Gloo down early can abort a slower one
    return 0


def _handle(args: argparse.Namespace) -> int:
    _csv(args.ops, OPS, "--ops")
    _csv(args.impl, IMPLS, "--impl")
    for s in args.sizes.split(","):
        parse_size(s)
    if args.nproc < 2:
        raise ValueError(f"--nproc must be >= 2 for collectives, got {args.nproc}")
    from torsh_distributed.elastic.launch import LaunchOptions, launch  # torch: after the checks

    forward = [
        "--ops",
        args.ops,
        "--sizes",
        args.sizes,
        "--impl",
        args.impl,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--rounds",
        str(args.rounds),
    ]
    if args.json:
        forward += ["--json", str(Path(args.json).resolve())]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return launch(
        LaunchOptions(nproc_per_node=args.nproc, env=env, local_ranks_filter=frozenset({0})),
        module="torsh_distributed.cli.bench",
        args=forward,
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` (with the ``collectives`` benchmark)."""
    parser = sub.add_parser("bench", help="benchmarks (collectives: nccl-tests-style busbw table)")
    kinds = parser.add_subparsers(dest="bench", metavar="BENCH")
    kinds.required = True
    coll = kinds.add_parser(
        "collectives",
        help="bandwidth of collectives: raw torch vs the facade and its algorithms",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    coll.add_argument("--nproc", type=int, default=2, help="local ranks to launch")
    _bench_args(coll)
    coll.set_defaults(handler=_handle)


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main())
