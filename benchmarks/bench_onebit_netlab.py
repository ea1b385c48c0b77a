"""1-bit Adam and 0/1 Adam vs AdamW under DDP on the network lab: 2 hosts x 1 rank, 10.9 M params.

The three optimizers train the same built-in GPT from the same seed side by side, stepping
round-robin (load drift hits all alike), over links limited to ``--rate`` Mbit/s. Reported per
method: seconds per step during the warm-up (steps 3 to ``freeze``) and after it, bytes this
rank sent per step after the warm-up, and the mean loss of the last 5 steps. AdamW's gradient
all-reduce is DDP's (overlapped with backward); the 1-bit methods' exchange runs in ``step()``.

Needs root (ip netns, tc); uses benchmarks/netlab::

    sudo .venv/bin/python benchmarks/bench_onebit_netlab.py --rate 100 --steps 30 --freeze 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("adamw", "onebit_adam", "zerooneadam")


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torsh_distributed.compression.onebit import OneBitAdam, ZeroOneAdam, replace_ddp_allreduce
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

    kw = {"lr": args.lr, "weight_decay": 0.01}
    runs = []
    for method in METHODS:
        torch.manual_seed(0)
        base = GPT(mcfg)
        model = apply_ddp(base, bucket_cap_mb=args.bucket_mb, find_unused_parameters=True)
        if method == "adamw":
            opt = torch.optim.AdamW(base.parameters(), **kw)
        elif method == "onebit_adam":
            opt = OneBitAdam(base.parameters(), freeze_step=args.freeze, **kw)
        else:
            opt = ZeroOneAdam(base.parameters(), var_freeze_step=args.freeze, **kw)
        if method != "adamw":
            replace_ddp_allreduce(model, opt)
        runs.append({"method": method, "model": model, "opt": opt, "times": [], "losses": []})
    nparams = sum(p.numel() for p in runs[0]["model"].parameters())
    for step in range(args.steps):
        for run in runs:
            dist.barrier()
            t0 = time.perf_counter()
            _, loss = run["model"](*batch(step))
            run["opt"].zero_grad(set_to_none=True)
            loss.backward()
            run["opt"].step()
            run["losses"].append(float(loss.detach()))
            run["times"].append(time.perf_counter() - t0)
    rows = []
    dense = int(2 * (world - 1) / world * 4 * nparams)
    for run in runs:
        times, opt = run["times"], run["opt"]
        after = opt.summary()["after_freeze"] if hasattr(opt, "summary") else None
        rows.append({
            "method": run["method"], "params": nparams,
            "warmup_s": statistics.fmean(times[2 : args.freeze]),
            "after_s": statistics.fmean(times[args.freeze :]),
            "bytes_after": after["bytes_sent"] / after["steps"] if after else dense,
            "bytes_dense": dense, "final_loss": statistics.fmean(run["losses"][-5:]), "times": times,
        })
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=100.0, help="link rate in Mbit/s")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--freeze", type=int, default=10)
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
        for name in ("steps", "freeze", "d_model", "n_layer", "n_head", "block_size", "batch_size", "lr",
                     "bucket_mb", "threads")
    ]
    out = Path(tempfile.mkdtemp(prefix="torsh-onebit-")) / "rows.json"
    with NetLab(hosts=2, rate_mbit=args.rate, net=71) as lab:
        procs = []
        for rank in range(2):
            env = lab.rank_env(rank=rank, world_size=2, ranks_per_host=1, master_port=29671)
            env["OMP_NUM_THREADS"] = str(args.threads)
            cmd = [sys.executable, __file__, *forward, "--worker", "--out", str(out)]
            procs.append(lab.popen(rank, cmd, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
        codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        print(f"ranks failed with exit codes {codes}")
        return 1
    rows = json.loads(out.read_text())
    base = rows[0]
    print(f"\n2 hosts x 1 rank at {args.rate:g} Mbit/s, {base['params'] / 1e6:.1f} M params, {args.steps} steps, "
          f"freeze {args.freeze}, batch {args.batch_size}/rank x {args.block_size} tokens, "
          f"{os.cpu_count()} CPU cores, torch threads/rank {args.threads}\n")
    print("| method | s/step, warm-up | s/step after | speed-up after vs adamw | MB sent/step after | ratio | loss (last 5) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['warmup_s']:.3f} | {r['after_s']:.3f} | {base['after_s'] / r['after_s']:.2f}x | "
              f"{r['bytes_after'] / 1e6:.2f} | {r['bytes_dense'] / r['bytes_after']:.1f}x | {r['final_loss']:.4f} |")
    print("\n" + json.dumps([{k: v for k, v in r.items() if k != "times"} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
