"""ZeRO stages 0-3 side by side: model-state bytes, peak process memory and step time per rank.

Runs the built-in trainer on N local CPU ranks (Gloo) once per stage with a model big enough
that model states dominate memory, and once per stage with a negligible model (1 block, width
8) to measure the process baseline honestly: Python, torch, Gloo, the corpus, the first forward
and backward's one-off allocations. Prints one markdown table:

* model states per rank: measured (summed from the tensors held after step 1) vs the planner
  (``layout="fsdp2"``: what this package holds between steps; equal to the ZeRO paper's fp32
  formula for stages 0, 1 and 3) and vs the paper's formula;
* peak resident memory per rank (max over ranks) vs the prediction = baseline run's peak +
  model states + the largest model-state transient + max(activations, optimizer temporary);
* step time per stage relative to DDP (stage 0), measured in the same run.

Usage::

    python benchmarks/bench_zero_memory.py --nproc 4 --d-model 512 --n-layer 8 --steps 4
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import platform
import sys
import time

from torsh_distributed.engine._memory import predict_peak_rss
from torsh_distributed.plan.memory import activation_bytes, model_state_bytes
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

_M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc malloc.h)


def _mb(num: float) -> str:
    return f"{num / 1e6:.1f} MB"


def _config(args: argparse.Namespace, stage: int, *, null: bool) -> dict:
    cfg = preset("tiny")
    cfg.model.n_layer = 1 if null else args.n_layer
    cfg.model.d_model = 8 if null else args.d_model
    cfg.model.n_head = 2 if null else args.n_head
    cfg.model.block_size = args.block_size
    cfg.max_steps = args.steps
    cfg.batch_size = args.batch
    cfg.eval_batches = 1
    cfg.progress = False
    cfg.threads = 1
    cfg.data.max_bytes = 300_000
    cfg.optim.warmup_steps = 1
    data = cfg.to_dict()
    data["parallel"] = {"zero_stage": stage}
    return data


def _rank(config: dict, mmap_threshold: int) -> dict:
    if mmap_threshold:
        # glibc serves large blocks from mmap (returned to the kernel on free) only above a
        # threshold that it raises dynamically; freed heap blocks then stay resident and RSS
        # stops tracking live tensors. Fixing the threshold makes RSS measure live memory.
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    started = time.perf_counter()
    result = train(TrainConfig.from_dict(config))
    tokens = config["batch_size"] * config["model"]["block_size"]
    return {
        "memory": result.memory,
        "num_params": result.num_params,
        "step_s": tokens / result.tokens_per_s,
        "final_loss": result.final_loss,
        "wall_s": time.perf_counter() - started,
    }


def _predict(args: argparse.Namespace, stage: int, num_params: int, baseline: int) -> int:
    d = args.d_model
    block = 12 * d * d + 13 * d  # qkv, proj, up, down weights and biases, two layer norms
    acts = activation_bytes(
        n_layer=args.n_layer,
        d_model=d,
        n_head=args.n_head,
        seq_len=args.block_size,
        batch=args.batch // args.nproc,
    )
    terms = predict_peak_rss(
        baseline=baseline,
        num_params=num_params,
        block_params=block,
        n_layer=args.n_layer,
        dp=args.nproc,
        stage=stage,
        param_dtype="fp32",
        activations=acts,
    )
    return terms["total"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--json", help="also write the raw figures to this file")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="glibc M_MMAP_THRESHOLD in bytes for every rank (0 = glibc's dynamic default)",
    )
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    # the harness starts functions by module name: use this file as an importable module
    import bench_zero_memory as this

    rows = []
    for stage in stages:
        null = run_distributed(
            this._rank,
            args.nproc,
            args=(_config(args, stage, null=True), args.mmap_threshold),
            timeout=600,
        )
        big = run_distributed(
            this._rank,
            args.nproc,
            args=(_config(args, stage, null=False), args.mmap_threshold),
            timeout=600,
        )
        baseline = max(r["memory"]["peak_rss_bytes"] for r in null)
        num_params = big[0]["num_params"]
        measured = [r["memory"]["model_state_bytes_per_rank"]["total"] for r in big]
        formula = model_state_bytes(num_params, args.nproc, stage, dtype="fp32", layout="fsdp2")
        paper = model_state_bytes(num_params, args.nproc, stage, dtype="fp32", layout="paper")
        peak = max(r["memory"]["peak_rss_bytes"] for r in big)
        rows.append(
            {
                "stage": stage,
                "num_params": num_params,
                "states_measured_max": max(measured),
                "states_measured_min": min(measured),
                "states_formula": formula.total,
                "states_paper": paper.total,
                "padding": max(
                    sum(r["memory"]["model_state_bytes_per_rank"]["padding"].values()) for r in big
                ),
                "baseline_peak_rss": baseline,
                "peak_rss": peak,
                "peak_rss_predicted": _predict(args, stage, num_params, baseline),
                "step_s": max(r["step_s"] for r in big),
                "final_loss": big[0]["final_loss"],
            }
        )
        print(f"stage {stage} done: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    ddp = next((r["step_s"] for r in rows if r["stage"] == 0), rows[0]["step_s"])
    print(
        f"\nZeRO memory benchmark: {args.nproc} CPU ranks (gloo), built-in GPT "
        f"{args.n_layer} x {args.d_model} ({rows[0]['num_params'] / 1e6:.1f}M params), fp32 AdamW, "
        f"global batch {args.batch} x {args.block_size} tokens, {args.steps} steps, "
        f"glibc mmap threshold {args.mmap_threshold or 'dynamic'}; "
        f"{platform.node()} ({platform.machine()})\n"
    )
    print(
        "| stage | model states/rank measured | formula (FSDP2 layout) | diff | paper formula "
        "| process baseline | peak RSS/rank | predicted | diff | step time | vs DDP |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        states = r["states_measured_max"]
        spread = (
            "" if r["states_measured_min"] == states else f" (min {_mb(r['states_measured_min'])})"
        )
        print(
            f"| {r['stage']} | {_mb(states)}{spread} | {_mb(r['states_formula'])} | "
            f"{100 * (states / r['states_formula'] - 1):+.2f} % | {_mb(r['states_paper'])} | "
            f"{_mb(r['baseline_peak_rss'])} | {_mb(r['peak_rss'])} | "
            f"{_mb(r['peak_rss_predicted'])} | "
            f"{100 * (r['peak_rss'] / r['peak_rss_predicted'] - 1):+.1f} % | "
            f"{r['step_s']:.2f} s | {r['step_s'] / ddp:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
