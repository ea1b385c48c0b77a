"""``torsh-dist plan simulate``: what one training step of a pinned layout takes and achieves.

Parses ``plan strategy``'s model and cluster flags plus the layout, runs
:func:`~torsh_distributed.plan.simulate.simulate` and prints step time, TFLOP/s per device, MFU,
memory per device, the breakdown and the critical path (or ``--json``); ``--trace FILE`` writes
a Chrome trace of the step.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from torsh_distributed.cli.plan_strategy import (
    add_model_and_cluster,
    add_simulate_flags,
    config,
    layout_options,
)
from torsh_distributed.plan.memory import format_bytes

if TYPE_CHECKING:
    from torsh_distributed.plan.simulate import SimResult

__all__ = ["add_simulate", "print_simulated"]

_EPILOG = """\
examples:
  # Megatron-LM 2021 (Narayanan et al., Table 1): 145.6B on 1536 A100 80GB, tp 8, pp 8
  torsh-dist plan simulate --params 145.6e9 --layers 80 --hidden 12288 --heads 96 \\
      --devices 1536 --nodes 192 --device-memory 80GB --intra-bw 300GB/s --inter-bw 1600Gbps \\
      --global-batch 2304 --seq-len 2048 --device a100 --no-flash-attention --dropout \\
      --tp 8 --pp 8 --micro-batch 1 --recompute full --pp-scatter-gather
  # the same with the interleaved schedule (2 chunks per rank) and a trace
  torsh-dist plan simulate ... --tp 8 --pp 8 --interleave 2 --trace step.json

dp = devices / (tp x pp x ep). --json prints {"step_s", "tflops_per_device", "mfu",
"memory_per_device_gb", "layout", "flops_per_step", "flop_count", "memory_bytes",
"breakdown_s", "critical_path": {"seconds_by_kind", "segments"}}.

The device model (GEMM and attention efficiency by shape, element-wise kernels by bandwidth)
has two efficiencies fitted on two published runs (Megatron-LM 1.7B and 145.6B); the validation
against the other published runs is in docs/benchmarks.md. On a CPU host, measure the device
with `torsh-dist plan profile` and pass --device cpu --device-profile FILE (see its --help).
See docs/planner.md, "Simulator".
"""


def print_simulated(result: SimResult) -> None:
    """The text report of one :class:`~torsh_distributed.plan.simulate.SimResult`."""
    out = result.to_dict()
    lay = out["layout"]
    print(
        f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']}"
        + (f" ep{lay['ep']}" if lay["ep"] > 1 else "")
        + f" z{lay['zero_stage']}, micro-batch {lay['micro_batch']} x {lay['microbatches']}, "
        f"{lay['schedule']}"
        + (f" (v {lay['interleave']})" if lay["interleave"] > 1 else "")
        + f", recompute {lay['recompute']}"
        + (", sequence parallel" if lay["sequence_parallel"] else "")
    )
    print(
        f"step {out['step_s']:.4g} s; {out['tflops_per_device']:.1f} TFLOP/s per device "
        f"({out['flop_count']}); MFU {out['mfu']:.1%} (model FLOPs, no recomputation); "
        f"memory {format_bytes(out['memory_bytes']['total'])} per device"
    )
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3g} s" for k, v in out["breakdown_s"].items())
    print(f"slowest rank: {parts}")
    path = out["critical_path"]
    kinds = ", ".join(f"{k} {v:.3g} s" for k, v in path["seconds_by_kind"].items())
    print(f"critical path: {kinds}")
    segments = path["segments"]
    shown = segments if len(segments) <= 12 else segments[:6] + [None] + segments[-5:]
    for seg in shown:
        if seg is None:
            print(f"  ... {len(segments) - 11} more segments")
            continue
        print(
            f"  {seg['start']:10.4f} - {seg['end']:10.4f} s  rank {seg['rank']:<3} "
            f"{seg['kind']} x{seg['count']} ({seg['what']})"
        )


def _handle(args: argparse.Namespace) -> int:
    from torsh_distributed.plan.simulate import SimLayout, simulate

    device = None
    if args.device_profile:
        from torsh_distributed.plan.device_profile import load

        device = load(args.device_profile)
    elif args.device == "cpu":
        raise ValueError(
            "--device cpu: the simulator has no CPU device model built in; measure one with "
            "`torsh-dist plan profile` and pass it as --device-profile FILE"
        )
    if args.device == "cpu" and not args.device_flops:
        args.device_flops = device.peak_flops if device else 1e9  # the planner's rate: unused
    cfg = config(args)
    lay = SimLayout(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        zero_stage=args.zero_stage,
        micro_batch=args.micro_batch,
        interleave=args.interleave,
        recompute=args.recompute,
        backend=args.backend,
        **layout_options(args),
    )
    result = simulate(cfg, lay, device=device, trace=args.trace is not None)
    if args.trace:
        result.write_trace(args.trace)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print_simulated(result)
        if args.trace:
            print(f"trace: {args.trace} ({len(result.events)} events)")
    return 0


def add_simulate(plan_sub: argparse._SubParsersAction) -> None:
    """Add ``plan simulate`` to the ``plan`` command's subparsers."""
    p = plan_sub.add_parser(
        "simulate",
        help="simulate one training step of a pinned layout: step time, TFLOP/s, MFU, memory",
        description=(
            "Plays one optimizer step of the layout event by event (pipeline schedule, tp/dp/pp "
            "collectives on a hierarchical network, ZeRO gathers, optimizer) with per-kernel "
            "costs from a device model calibrated on published runs; see docs/planner.md."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _, t = add_model_and_cluster(p)
    t.add_argument("--tp", type=int, default=1, help="tensor parallelism (1)")
    t.add_argument("--pp", type=int, default=1, help="pipeline ranks (1)")
    t.add_argument("--ep", type=int, default=1, help="expert parallelism (1)")
    t.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (1)")
    t.add_argument("--interleave", type=int, default=1, help="model chunks per pipeline rank (1)")
    t.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default="none",
        help="activation recomputation (none)",
    )
    t.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage 0-3 (0)")
    add_simulate_flags(t)
    t.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl",
        help="collective library: nccl (default) or gloo (its reduce-scatter costs an all-reduce)",
    )
    p.add_argument(
        "--device-profile",
        metavar="FILE",
        help="a measured device model (torsh-dist plan profile) instead of --device's",
    )
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the step")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    # plan strategy's search and rate flags do not apply: the device model sets the rate
    p.set_defaults(
        handler=_handle,
        device_flops=0.0,
        mfu=0.5,
        profile=None,
        activation_checkpointing="auto",
        max_micro_batch=64,
        stages=(0, 1, 2, 3),
        ref_batch=0,
        ref_lr=None,
        ref_warmup_steps=0,
    )
