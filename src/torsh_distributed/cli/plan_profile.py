"""``torsh-dist plan profile``: measure this host as a device model for ``plan simulate``.

Times, on this machine, every GEMM shape the simulator asks for when it costs one layer and the
logits of the given model at the given tensor-parallel degrees and micro-batches, plus the
element-wise rate, fused attention and the optimizer step
(:func:`torsh_distributed.plan.device_profile.measure`), and writes them as JSON for ``plan
simulate --device cpu --device-profile FILE``. Torch is imported only to measure.
"""

from __future__ import annotations

import argparse
import json
import os

from torsh_distributed.plan.memory import DTYPES

__all__ = ["add_profile"]

_EPILOG = """\
example (the built-in GPT of benchmarks/bench_sim_netlab.py, 2 ranks sharing this host):
  torsh-dist plan profile --hidden 384 --heads 4 --seq-len 128 --vocab 256 --dtype fp32 \\
      --micro-batch 4 8 --processes 2 --out cpu.json
  torsh-dist plan simulate --params 7.3e6 --layers 4 --hidden 384 --heads 4 --seq-len 128 \\
      --vocab 256 --dtype fp32 --devices 2 --nodes 2 --device-memory 24GB --intra-bw 1TB/s \\
      --inter-bw 100Mbps --global-batch 16 --micro-batch 8 --zero-stage 3 --backend gloo \\
      --device cpu --device-profile cpu.json

The profile holds the kernels of this model shape only: simulate the same hidden, heads,
sequence length, dtype, tp degrees and micro-batches (a shape not profiled falls back to the
roofline of the measured peak, which a CPU does not follow well).
"""


def _handle(args: argparse.Namespace) -> int:
    from torsh_distributed.plan._sim_layout import SimLayout
    from torsh_distributed.plan._strategy_config import StrategyConfig
    from torsh_distributed.plan.device_profile import measure

    if args.hidden % args.heads or min(args.tp) < 1 or min(args.micro_batch) < 1:
        raise ValueError("--heads must divide --hidden; --tp and --micro-batch must be >= 1")
    cfg = StrategyConfig(
        params=12.0 * args.hidden**2,
        layers=1,
        hidden=args.hidden,
        heads=args.heads,
        seq_len=args.seq_len,
        vocab=args.vocab,
        devices=max(args.tp),
        nodes=1,
        device_memory=1e12,
        intra_bw=1e12,
        inter_bw=1e12,
        dtype=args.dtype,
        device="cpu",
        device_flops=1e12,
        flash_attention=args.flash_attention,
    )
    layouts = [
        SimLayout(
            tp=tp,
            micro_batch=mb,
            ffn_hidden=args.ffn_hidden,
            kv_heads=args.kv_heads,
            gated_mlp=args.gated_mlp,
        )
        for mb in args.micro_batch
        for tp in args.tp
    ]
    profile = measure(
        cfg, layouts, processes=args.processes, threads=args.threads, repeats=args.repeats
    )
    tmp = f"{args.out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:  # written whole, then renamed: no half-written profile
        json.dump(profile, f, indent=1)
    os.replace(tmp, args.out)
    print(
        f"{args.out}: {len(profile['measured'])} GEMM shapes; fastest GEMM "
        f"{profile['peak_flops'] / 1e9:.1f} GFLOP/s, element-wise {profile['hbm_bw'] / 1e9:.2f} "
        f"GB/s, attention {profile['attn_eff']:.2f} of it, optimizer "
        f"{profile['optimizer_per_param'] * 1e9:.2f} ns/param ({profile['source']})"
    )
    return 0


def add_profile(plan_sub: argparse._SubParsersAction) -> None:
    """Add ``plan profile`` to the ``plan`` command's subparsers."""
    p = plan_sub.add_parser(
        "profile",
        help="measure this host's kernels as a device model for plan simulate (CPU)",
        description=(
            "Times the GEMM shapes, element-wise kernels, fused attention and optimizer step "
            "the simulator needs for one model shape, with --processes copies at once (the ranks "
            "that will share this host's cores); writes a device profile for plan simulate "
            "--device-profile. See docs/planner.md, 'Simulator'."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hidden", type=int, required=True, help="width of the residual stream")
    p.add_argument("--heads", type=int, required=True, help="attention heads")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (2048)")
    p.add_argument("--vocab", type=int, default=51200, help="vocabulary size (51200)")
    p.add_argument("--ffn-hidden", type=int, default=0, help="MLP width (default 4 x --hidden)")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default --heads)")
    p.add_argument("--gated-mlp", action="store_true", help="SwiGLU MLP: three matrices")
    p.add_argument(
        "--no-flash-attention",
        dest="flash_attention",
        action="store_false",
        help="attention as two batched GEMMs and a softmax (default: fused)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="fp32 (default), bf16, fp16")
    p.add_argument(
        "--micro-batch", type=int, nargs="+", default=[1], help="micro-batches to time (1)"
    )
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="tp degrees to time (1)")
    p.add_argument(
        "--processes", type=int, default=1, help="copies timing at once: ranks per host (1)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per copy (1)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per kernel, median (5)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the profile")
    p.set_defaults(handler=_handle)
