"""1-bit Adam and 0/1 Adam vs uncompressed AdamW (and TopK 1 % under AdamW) on 2 CPU ranks.

The compression bar's setting (benchmarks/bench_compression_optimizers.py): the built-in trainer,
``tiny`` preset, global batch 8, validation loss on 8 fixed batches, AdamW lr 3e-3 with betas
0.9/0.95, weight decay 0.01 on matrices, clip 1.0, the same seed and sample order for every run.
Prints each method's validation-loss gap to uncompressed AdamW and the bytes this rank sent,
in total and after the warm-up (``freeze_step``), against DDP's fp32 all-reduce of the same
steps.

    python benchmarks/bench_onebit_adam.py --steps 60 --freeze 15,20 --seeds 1234,1,2
    # the 10.9 M model of the network-lab benchmark (d_model 384, 6 layers, 6 heads, context 64)
    python benchmarks/bench_onebit_adam.py --steps 200 --model 384,6,6,64 --lr 1e-3 --freeze 50 --topk ""

Loss is deterministic given the seed; bytes are counted, not timed.
"""

from __future__ import annotations

import argparse

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train


def _config(method: str, steps: int, seed: int, args: argparse.Namespace) -> dict:
    cfg = preset("tiny")
    cfg.max_steps, cfg.batch_size, cfg.seed = steps, 8, seed
    if args.model:
        m = cfg.model
        m.d_model, m.n_layer, m.n_head, m.block_size = (int(v) for v in args.model.split(","))
    if args.lr:
        cfg.optim.lr = args.lr
    cfg.progress = False
    cfg.eval_batches = 8
    name, _, freeze = method.partition("@")
    if name in ("onebit_adam", "zerooneadam"):
        cfg.optim.optimizer = name
        cfg.optim.freeze_step = int(freeze)
    elif name != "adamw":
        cfg.compression.method = name
    return cfg.to_dict()


def _rank(runs: dict[str, dict]) -> dict[str, dict]:
    out = {}
    for key, cfg in runs.items():
        result = train(TrainConfig.from_dict(cfg))
        out[key] = {"val": result.val_loss, "compression": result.compression}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--freeze", default="15", help="comma-separated freeze steps")
    parser.add_argument("--seeds", default="1234")
    parser.add_argument("--topk", default="topk:0.01", help="a compressor under AdamW to compare ('' skips)")
    parser.add_argument("--model", default="", help="d_model,n_layer,n_head,block_size (default: tiny)")
    parser.add_argument("--lr", type=float, default=0.0, help="peak lr (default: the preset's 3e-3)")
    args = parser.parse_args()
    freezes = [int(f) for f in args.freeze.split(",")]
    methods = ["adamw", *([args.topk] if args.topk else [])]
    methods += [f"{name}@{f}" for f in freezes for name in ("onebit_adam", "zerooneadam")]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {f"{seed}|{m}": _config(m, args.steps, seed, args) for seed in seeds for m in methods}
    out = run_distributed(_rank, 2, args=(runs,), timeout=7200)[0]
    model = f"model {args.model}" if args.model else "tiny preset"
    print(f"2 ranks, {model}, {args.steps} steps, validation loss gap vs uncompressed AdamW\n")
    print("| method | freeze | seed | val loss | gap | bytes sent | ratio | after freeze: bytes | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed in seeds:
        base = out[f"{seed}|adamw"]["val"]
        for m in methods:
            r = out[f"{seed}|{m}"]
            c = r["compression"]
            name, _, freeze = m.partition("@")
            after = c.get("after_freeze")
            tail = f"{after['bytes_sent']:,} | {after['ratio']:.1f}x" if after else "- | -"
            print(
                f"| {name} | {freeze or '-'} | {seed} | {r['val']:.3f} | {(r['val'] - base) / base:+.1%} | "
                f"{c['bytes_sent']:,} | {c['ratio']:.1f}x | {tail} |"
            )


if __name__ == "__main__":
    main()
