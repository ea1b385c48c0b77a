"""The link monitor's fit (``comm/bandwidth.py``) fed with plain all-reduces of chosen sizes.

2 hosts x 1 rank on the network lab. Each round all-reduces messages of ``--sizes-kb`` one at a
time (a busy period of one message each, a pause between them so that ``tbf``'s bucket refills,
as between the priority exchange's busy periods) and ``--periods``-message back-to-back runs of
each size (a period of several messages). Every period feeds a :class:`BandwidthEstimator`; the
estimate is printed per set of sizes beside the aggregate rate of the largest messages, against
the ``tc`` rate. What it separates: whether the estimator or the host limits the figure the
training run reports (where busy periods are at most a few MB).

Needs root (ip netns, tc)::

    .venv/bin/python benchmarks/bench_link_estimate_netlab.py --rate 1000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torsh_distributed.comm.bandwidth import BandwidthEstimator

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if args.probe:
        from torsh_distributed.comm.link_probe import probe_group_link

        probes = []
        for _ in range(args.probe):
            t0 = time.perf_counter()
            link = probe_group_link(target_s=args.target_ms / 1e3)
            probes.append({**link.to_dict(), "seconds": round(time.perf_counter() - t0, 4)})
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps({"probes": probes}))
        dist.destroy_process_group()
        return
    sizes = [int(s) * 1024 for s in args.sizes_kb.split(",")]
    rows = []
    for k, n, t in _measure(dist, torch, sizes, args):
        rows.append((k, n, t))
    out = {"samples": rows}
    for name, cut in (("all", 0), ("<=4MiB", 4 << 20), ("<=1MiB", 1 << 20)):
        est = BandwidthEstimator(world_size=2)
        for k, n, t in rows:
            if not cut or n / k <= cut:
                est.add(int(n), t, messages=int(k))
        link = est.estimate()
        out[name] = link.to_dict() if link else {}
    big = [r for r in rows if r[1] / r[0] == max(sizes)]
    out["largest_aggregate_mbit"] = sum(n for _, n, _ in big) * 8 / sum(t for *_, t in big) / 1e6
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _measure(dist, torch, sizes: list[int], args: argparse.Namespace):  # noqa: ANN001, ANN202
    for _ in range(args.rounds):
        for size in sizes:
            buf = torch.ones(size // 4)
            for messages in (1, args.periods):
                dist.barrier()
                time.sleep(args.gap_ms / 1e3)  # the bucket refills, as between busy periods
                works = []
                t0 = time.perf_counter()
                for _ in range(messages):
                    works.append(dist.all_reduce(buf, async_op=True))
                for work in works:
                    work.wait()
                yield messages, messages * size, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="link rate in Mbit/s")
    parser.add_argument("--sizes-kb", default="64,256,1024,4096,16384,65536")
    parser.add_argument("--periods", type=int, default=3, help="messages in a multi-message period")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument(
        "--probe", type=int, default=0,
        help="instead: run comm.link_probe.probe_group_link this many times and print each estimate",
    )  # fmt: skip
    parser.add_argument("--target-ms", type=float, default=50.0, help="--probe's target_s")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    from netlab import NetLab, available

    reason = available()
    if reason:
        print(f"skipped: {reason}")
        return 0
    out = Path(tempfile.mkdtemp(prefix="torsh-link-")) / "out.json"
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    forward = [f"--sizes-kb={args.sizes_kb}", f"--periods={args.periods}",
               f"--rounds={args.rounds}", f"--gap-ms={args.gap_ms}",
               f"--probe={args.probe}", f"--target-ms={args.target_ms}"]  # fmt: skip
    cmd = [sys.executable, __file__, *forward, "--worker", "--out", str(out)]
    with NetLab(hosts=2, rate_mbit=args.rate, net=44) as lab:
        procs = []
        for rank in range(2):
            env = lab.rank_env(rank=rank, world_size=2, ranks_per_host=1, master_port=29644)
            env["OMP_NUM_THREADS"] = "1"
            procs.append(
                lab.popen(rank, cmd, env=env, stdout=None if rank == 0 else subprocess.DEVNULL)
            )
        codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        print(f"ranks failed with exit codes {codes}")
        return 1
    res = json.loads(out.read_text())
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"\n2 hosts x 1 rank at {args.rate:g} Mbit/s, {os.cpu_count()} CPU cores, load "
          f"{' '.join(load_before)} -> {' '.join(load_after)}\n")  # fmt: skip
    if args.probe:
        print("| probe | estimate Mbit/s | of the tc rate | latency ms | seconds |")
        print("|---|---:|---:|---:|---:|")
        for i, p in enumerate(res["probes"]):
            print(f"| {i + 1} | {p['bandwidth_mbit']:.1f} | {p['bandwidth_mbit'] / args.rate:.1%} "
                  f"| {p['latency_ms']:.2f} | {p['seconds']:.3f} |")  # fmt: skip
        print("\n" + json.dumps(res))
        return 0
    print("| periods used | estimate Mbit/s | of the tc rate | latency ms | periods |")
    print("|---|---:|---:|---:|---:|")
    for name in ("all", "<=4MiB", "<=1MiB"):
        fit = res[name]
        if fit:
            print(f"| messages {name} | {fit['bandwidth_mbit']:.1f} | "
                  f"{fit['bandwidth_mbit'] / args.rate:.1%} | {fit['latency_ms']:.2f} | "
                  f"{fit['samples']} |")  # fmt: skip
    agg = res["largest_aggregate_mbit"]
    print(f"\nlargest messages alone, bytes / seconds: {agg:.1f} Mbit/s ({agg / args.rate:.1%})")
    print("\n" + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
