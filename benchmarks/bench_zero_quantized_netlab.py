"""ZeRO-2/3 with int8 quantised collectives on the network lab, beside uncompressed ZeRO and DDP.

2 hosts x 1 rank (network namespaces, ``tc`` rate limit; needs root), the built-in GPT (default
d_model 384, 6 layers: 10.9 M parameters). Every run trains the same model from the same seed on
the same batches, all side by side, one step each in turn (a change of machine load hits every run
alike), and reports seconds per step, bytes per step and rank, and the final loss:

* ``zero2`` / ``zero3``: FSDP2 (``apply_fsdp``), fp32 all-gather and reduce-scatter;
* ``zero2-int8`` / ``zero3-int8``: the same with ``quantize_collectives`` (ZeRO++'s qwZ + qgZ);
* ``ddp`` / ``ddp-powersgd:4``: DDP, plain or with the PowerSGD rank-4 hook.

Bytes of the fp32 ZeRO runs are those of the same collectives counted by the int8 runs
(``bytes_uncompressed``: the collectives do not change with the quantisation)::

    sudo .venv/bin/python benchmarks/bench_zero_quantized_netlab.py --rates 100 --steps 12
    sudo .venv/bin/python benchmarks/bench_zero_quantized_netlab.py --rates 0 --steps 200 \\
        --runs zero2,zero2-int8      # loss at 200 steps, unlimited link
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

RUNS = "zero2,zero2-int8,zero3,zero3-int8,ddp,ddp-powersgd:4"


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torsh_distributed.compression import build_compressor, register_compression
    from torsh_distributed.data.corpus import load_corpus, sample_batch
    from torsh_distributed.models.gpt import GPT, Block
    from torsh_distributed.parallel.data import apply_ddp
    from torsh_distributed.parallel.sharded import apply_fsdp, quantize_collectives, select_units
    from torsh_distributed.train.config import DataConfig, ModelConfig

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    mcfg = ModelConfig(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model
    )
    corpus = load_corpus(DataConfig(max_bytes=2_000_000), min_tokens=args.block_size + 2)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_batch(corpus.train, seed=1, step=step, batch_size=args.batch_size * world,
                            block_size=args.block_size, rank=rank, num_ranks=world)

    runs = []
    for name in args.runs.split(","):
        torch.manual_seed(0)
        model = GPT(mcfg)
        stats, hook = None, None
        if name.startswith("zero"):
            stage = int(name[4])
            apply_fsdp(model, mesh, stage=stage, units=select_units(model, module_types=(Block,)))
            if name.endswith("int8"):
                stats = quantize_collectives(model)
            forward = model
        else:
            forward = apply_ddp(model, bucket_cap_mb=25.0, find_unused_parameters=True)
            method = name.partition("-")[2]
            if method:
                hook = register_compression(forward, build_compressor(method, seed=1))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        runs.append({"name": name, "model": forward, "opt": opt, "stats": stats, "hook": hook,
                     "times": [], "losses": []})
    nparams = sum(p.numel() for p in GPT(mcfg).parameters())
    for step in range(args.steps):
        x, y = batch(step)
        for run in runs:
            dist.barrier()
            t0 = time.perf_counter()
            _, loss = run["model"](x, y)
            run["opt"].zero_grad(set_to_none=True)
            loss.backward()
            run["opt"].step()
            run["losses"].append(float(loss.detach()))
            run["times"].append(time.perf_counter() - t0)
        if rank == 0 and (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  step {step + 1}: " + ", ".join(
                f"{r['name']} {r['losses'][-1]:.3f}" for r in runs), flush=True)
    dense_ddp = 2 * (world - 1) / world * 4 * nparams
    rows = []
    for run in runs:
        stats, hook = run["stats"], run["hook"]
        if stats is not None:
            sent, full = stats.bytes_sent / args.steps, stats.bytes_uncompressed / args.steps
        elif hook is not None:
            sent, full = hook.total.bytes_sent / hook.steps, hook.total.bytes_uncompressed / hook.steps
        else:
            sent = full = dense_ddp if run["name"] == "ddp" else float("nan")
        rows.append({
            "run": run["name"], "params": nparams, "steps": args.steps,
            "step_s": statistics.fmean(run["times"][2:]) if args.steps > 3 else run["times"][-1],
            "bytes_per_step": sent, "bytes_uncompressed": full,
            "final_loss": statistics.fmean(run["losses"][-5:]), "times": run["times"],
        })
    # fp32 ZeRO: the bytes its int8 twin counted as uncompressed
    by_name = {r["run"]: r for r in rows}
    for stage in ("zero2", "zero3"):
        if stage in by_name and f"{stage}-int8" in by_name:
            twin = by_name[f"{stage}-int8"]["bytes_uncompressed"]
            by_name[stage]["bytes_per_step"] = by_name[stage]["bytes_uncompressed"] = twin
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _table(rate: float, rows: list[dict]) -> str:
    ref = {r["run"]: r for r in rows}
    lines = [
        f"\n**{rate:g} Mbit/s** (0 = unlimited), {rows[0]['params'] / 1e6:.1f} M params, "
        f"{rows[0]['steps']} steps\n",
        "| run | s/step | MB sent/step/rank | final loss (last 5) | loss vs uncompressed twin | "
        "speed-up vs zero2 | vs zero3 | vs ddp-powersgd:4 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = r["run"].removesuffix("-int8")
        twin = ref.get("ddp" if base.startswith("ddp-") else base)
        gap = (r["final_loss"] - twin["final_loss"]) / twin["final_loss"] if twin else 0.0

        def vs(name: str, r: dict = r) -> str:
            return f"{ref[name]['step_s'] / r['step_s']:.2f}x" if name in ref else "-"

        lines.append(
            f"| {r['run']} | {r['step_s']:.3f} | {r['bytes_per_step'] / 1e6:.2f} | "
            f"{r['final_loss']:.4f} | {gap:+.2%} | {vs('zero2')} | {vs('zero3')} | "
            f"{vs('ddp-powersgd:4')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="100", help="link rates in Mbit/s (0 = unlimited)")
    parser.add_argument("--runs", default=RUNS, help=f"comma-separated subset of {RUNS}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
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
        for name in ("runs", "steps", "d_model", "n_layer", "n_head", "block_size", "batch_size",
                     "lr", "threads")
    ]
    results = {}
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        out = Path(tempfile.mkdtemp(prefix="torsh-zeroq-")) / "rows.json"
        print(f"link {rate:g} Mbit/s ...", flush=True)
        with NetLab(hosts=2, rate_mbit=rate, net=60 + i) as lab:
            procs = []
            for rank in range(2):
                env = lab.rank_env(rank=rank, world_size=2, ranks_per_host=1, master_port=29661)
                env["OMP_NUM_THREADS"] = str(args.threads)
                cmd = [sys.executable, __file__, *forward, "--worker", "--out", str(out)]
                procs.append(lab.popen(rank, cmd, env=env,
                                       stdout=None if rank == 0 else subprocess.DEVNULL))
            codes = [p.wait(timeout=args.timeout) for p in procs]
        if any(codes):
            print(f"ranks failed with exit codes {codes}")
            return 1
        results[rate] = json.loads(out.read_text())
    print(f"\n2 hosts x 1 rank, batch {args.batch_size}/rank x {args.block_size} tokens, "
          f"{os.cpu_count()} CPU cores, torch threads/rank {args.threads}")
    for rate, rows in results.items():
        print(_table(rate, rows))
    print("\n" + json.dumps({k: [{x: v for x, v in r.items() if x != "times"} for r in rows]
                             for k, rows in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
