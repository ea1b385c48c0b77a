"""Gradient compression on the network lab: 2 hosts x 1 rank, the built-in model at 10-25 M params.

For each link rate (default 100 Mbit/s and 1 Gbit/s) and each method, trains the same model from
the same seed for a fixed number of steps (all methods side by side, stepping round-robin) and
reports steps/s, bytes sent per step, codec
seconds per step, final loss, the measured speed-up over ``none`` and the method's ideal bound
``(compute + comm_none) / (compute + codec + comm_method)``, where ``compute`` is the measured
step time without communication (DDP ``no_sync``), ``codec`` the method's measured
compress + decompress time and ``comm_x = bytes_x / link rate``. ``auto`` is reported over the
whole run and after its probing phase.

Needs root (ip netns, tc); uses benchmarks/netlab::

    sudo .venv/bin/python benchmarks/bench_compression.py --rates 100,1000 --steps 30
    sudo .venv/bin/python benchmarks/bench_compression.py --d-model 512 --n-layer 8   # ~25 M params
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = "none,fp16,int8,topk:0.01,powersgd:2,powersgd:4,auto"


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torsh_distributed.compression import build_compressor, register_compression
    from torsh_distributed.compression.adaptive import Adaptive
    from torsh_distributed.data.corpus import load_corpus, sample_batch
    from torsh_distributed.models.gpt import GPT
    from torsh_distributed.parallel.data import apply_ddp
    from torsh_distributed.train.config import DataConfig, ModelConfig

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = ModelConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model)
    corpus = load_corpus(DataConfig(max_bytes=2_000_000), min_tokens=args.block_size + 2)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_batch(corpus.train, seed=1, step=step, batch_size=args.batch_size * world,
                            block_size=args.block_size, rank=rank, num_ranks=world)

    # All methods live side by side and step round-robin, so a change of machine load (shared
    # CI hosts) hits every method alike instead of whichever ran at that moment.
    methods = args.methods.split(",")
    runs = []
    for method in methods:
        torch.manual_seed(0)
        base = GPT(mcfg)
        model = apply_ddp(base, bucket_cap_mb=args.bucket_mb, find_unused_parameters=True)
        hook = None if method == "none" else register_compression(model, build_compressor(method, seed=1))
        runs.append({"method": method, "base": base, "model": model, "hook": hook, "times": [],
                     "losses": [], "compute": []})
    nparams = sum(p.numel() for p in runs[0]["base"].parameters())
    dense = int(2 * (world - 1) / world * 4 * nparams)
    # compute time: forward + backward + optimizer step without communication (DDP no_sync)
    probe_base = GPT(mcfg)
    probe = apply_ddp(probe_base, bucket_cap_mb=args.bucket_mb, find_unused_parameters=True)
    probe_opt = torch.optim.AdamW(probe_base.parameters(), lr=args.lr)
    compute = []
    for i in range(4):
        t0 = time.perf_counter()
        _step(probe, probe_opt, *batch(10_000 + i), sync=False)
        compute.append(time.perf_counter() - t0)
    del probe, probe_base, probe_opt
    for run in runs:
        run["opt"] = torch.optim.AdamW(run["base"].parameters(), lr=args.lr)
    for step in range(args.steps):
        for run in runs:
            dist.barrier()
            t0 = time.perf_counter()
            run["losses"].append(_step(run["model"], run["opt"], *batch(step)))
            run["times"].append(time.perf_counter() - t0)
    rows = []
    for run in runs:
        hook, times, losses = run["hook"], run["times"], run["losses"]
        if hook is None:
            sent, codec = dense, 0.0
        else:
            sent = hook.total.bytes_sent / hook.steps
            codec = (hook.total.compress_s + hook.total.decompress_s) / hook.steps
        row = {
            "method": run["method"], "params": nparams, "steps": args.steps,
            "step_s": statistics.fmean(times[2:]), "compute_s": statistics.median(compute[1:]),
            "codec_s": codec, "bytes_per_step": sent, "bytes_dense": dense,
            "final_loss": statistics.fmean(losses[-5:]), "times": times,
        }
        if hook is not None and isinstance(hook.compressor, Adaptive):
            auto = hook.compressor
            row["probe_end"] = auto.warmup_steps + auto.probe_repeats * len(auto.ladder)
            row["decisions"] = list(auto.decisions)
            row["choice"] = {str(k): auto.ladder[v] for k, v in auto.choice.items()}
        rows.append(row)
        if rank == 0:
            print(f"  {row['method']}: {row['step_s']:.3f} s/step, {sent / 1e6:.2f} MB/step, "
                  f"loss {row['final_loss']:.4f}", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _step(model, opt, x, y, *, sync: bool = True) -> float:  # noqa: ANN001
    ctx = model.no_sync() if not sync else contextlib.nullcontext()
    with ctx:
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
    opt.step()
    return float(loss.detach())


def _table(rate: float, rows: list[dict]) -> str:
    link = rate * 1e6 / 8  # bytes/s
    none = next(r for r in rows if r["method"] == "none")
    comp = none["compute_s"]
    lines = [
        f"\n**{rate:g} Mbit/s**, {none['params'] / 1e6:.1f} M params, compute (no comm) "
        f"{comp:.3f} s/step, none's comm time {max(none['step_s'] - comp, 0):.3f} s/step "
        f"for {none['bytes_per_step'] / 1e6:.1f} MB (link: {none['bytes_per_step'] / link:.3f} s)\n",
        "| method | steps/s | MB sent/step | ratio | codec s/step | final loss | loss gap | speed-up vs none | ideal bound | of bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        bound = (comp + none["bytes_per_step"] / link) / (comp + r["codec_s"] + r["bytes_per_step"] / link)
        speed = none["step_s"] / r["step_s"]
        gap = (r["final_loss"] - none["final_loss"]) / none["final_loss"]
        lines.append(
            f"| {r['method']} | {1 / r['step_s']:.3f} | {r['bytes_per_step'] / 1e6:.2f} | "
            f"{r['bytes_dense'] / r['bytes_per_step']:.1f} | {r['codec_s']:.3f} | {r['final_loss']:.4f} | "
            f"{gap:+.1%} | {speed:.2f}x | {bound:.2f}x | {speed / bound:.2f} |"
        )
        if r["method"] == "auto" and r.get("probe_end", 10**9) < len(r["times"]):
            # the same steps for every method: load on a shared host drifts over the run
            window = slice(r["probe_end"], None)
            mean = {x["method"]: statistics.fmean(x["times"][window]) for x in rows}
            best = min((m for m in mean if m != "auto"), key=mean.__getitem__)
            lines.append(
                f"| auto after probing (steps {r['probe_end'] + 1}-{len(r['times'])}) | {1 / mean['auto']:.3f} "
                f"| | | | | | {mean['none'] / mean['auto']:.2f}x | | best fixed ({best}, same steps) "
                f"{1 / mean[best]:.3f} steps/s: auto/best = {mean[best] / mean['auto']:.2f} |"
            )
    auto = next((r for r in rows if r["method"] == "auto"), None)
    if auto:
        lines.append(f"\nauto chose {auto.get('choice')}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,1000", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600)
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
    forward = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("methods", "steps", "d_model", "n_layer", "n_head", "block_size", "batch_size",
                     "lr", "bucket_mb", "threads")
    ]
    results = {}
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        out = Path(tempfile.mkdtemp(prefix="torsh-compress-")) / "rows.json"
        print(f"link {rate:g} Mbit/s ...", flush=True)
        with NetLab(hosts=2, rate_mbit=rate, net=40 + i) as lab:
            procs = []
            for rank in range(2):
                env = lab.rank_env(rank=rank, world_size=2, ranks_per_host=1, master_port=29641)
                env["OMP_NUM_THREADS"] = str(args.threads)
                cmd = [sys.executable, __file__, *forward, "--worker", "--out", str(out)]
                procs.append(lab.popen(rank, cmd, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
            codes = [p.wait(timeout=args.timeout) for p in procs]
        if any(codes):
            print(f"ranks failed with exit codes {codes}")
            return 1
        results[rate] = json.loads(out.read_text())
    print(f"\n2 hosts x 1 rank, {args.steps} steps, batch {args.batch_size}/rank x {args.block_size} tokens, "
          f"{os.cpu_count()} CPU cores, torch threads/rank {args.threads}")
    for rate, rows in results.items():
        print(_table(rate, rows))
    print("\n" + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
