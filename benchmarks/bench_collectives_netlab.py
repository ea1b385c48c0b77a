"""All-reduce algorithms on the network lab: 2 simulated hosts x 2 ranks, 100 Mbit between hosts.

Runs ``torsh_distributed.cli.bench`` on 4 ranks placed in two network namespaces (needs root) and
prints the nccl-tests-style table plus the acceptance ratios: flat ring busbw / link rate,
hierarchical speed-up over the flat ring (theory 1.5x) and which algorithm ``auto`` picked::

    sudo .venv/bin/python benchmarks/bench_collectives_netlab.py --rate-mbit 100 --sizes 4M
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netlab import NetLab, available  # noqa: E402

from torsh_distributed.cli.bench import format_table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--sizes", default="4M")
    parser.add_argument(
        "--ops",
        default="all_reduce",
        help="comma list: all_reduce, all_gather, reduce_scatter, ...",
    )
    parser.add_argument("--impl", default="torch,ring,hierarchical,auto")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=540)
    args = parser.parse_args()
    reason = available()
    if reason:
        print(f"skipped: {reason}")
        return 0
    world = args.hosts * args.ranks_per_host
    tmp = tempfile.TemporaryDirectory(prefix="torsh-netlab-")
    out = Path(tmp.name) / "rows.json"
    with tmp, NetLab(hosts=args.hosts, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms) as lab:
        procs = []
        for rank in range(world):
            cmd = [
                sys.executable,
                "-m",
                "torsh_distributed.cli.bench",
                "--ops",
                args.ops,
                "--sizes",
                args.sizes,
                "--impl",
                args.impl,
                "--iters",
                str(args.iters),
                "--warmup",
                "1",
                "--rounds",
                str(args.rounds),
                "--json",
                str(out),
            ]
            env = lab.rank_env(
                rank=rank, world_size=world, ranks_per_host=args.ranks_per_host, master_port=29611
            )
            procs.append(
                lab.popen(
                    rank // args.ranks_per_host,
                    cmd,
                    env=env,
                    stdout=None if rank == 0 else __import__("subprocess").DEVNULL,
                )
            )
        codes = [p.wait(timeout=args.timeout) for p in procs]
        if any(codes):
            print(f"ranks failed with exit codes {codes}")
            return 1
        rows = json.loads(out.read_text())["rows"]
    link = args.rate_mbit * 1e6 / 8 / 1e9  # GB/s
    print(
        f"\nlink rate {args.rate_mbit:g} Mbit/s = {link:.5f} GB/s; {args.hosts} hosts x {args.ranks_per_host} ranks"
    )
    by = {(r["size"], r["impl"]): r for r in rows if r["op"] == "all_reduce"}
    print(
        "\n| size (B) | ring busbw / link | hierarchical speed-up vs ring | auto picked | auto time / best |"
    )
    print("|---:|---:|---:|---|---:|")
    for size in sorted({size for size, _ in by}):
        ring, hier, auto = (
            by.get((size, "ring")),
            by.get((size, "hierarchical")),
            by.get((size, "auto")),
        )
        ratio = f"{ring['busbw_GBps'] / link:.3f}" if ring and args.rate_mbit else "-"
        speed = f"{ring['time_us'] / hier['time_us']:.2f}x" if ring and hier else "-"
        best = min(r["time_us"] for (s, impl), r in by.items() if s == size and impl != "auto")
        pick = f"{auto['algorithm']} | {auto['time_us'] / best:.2f}" if auto else "- | -"
        print(f"| {size} | {ratio} | {speed} | {pick} |")
    print()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
