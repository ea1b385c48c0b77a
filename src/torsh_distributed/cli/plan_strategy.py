"""``torsh-dist plan strategy``: recommend dp/tp/pp/ep, ZeRO stage, micro-batch and lr rule.

Parses sizes and rates, builds a :class:`~torsh_distributed.plan.strategy.StrategyConfig` and
prints :func:`~torsh_distributed.plan.strategy.plan_strategy`'s ranked table (or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from torsh_distributed.plan.memory import DTYPES, OPTIMIZERS, format_bytes
from torsh_distributed.plan.profile import Profile
from torsh_distributed.plan.strategy import (
    DEVICE_PEAK_FLOPS,
    StrategyConfig,
    StrategyPlan,
    explain,
    plan_strategy,
)

__all__ = [
    "add_model_and_cluster",
    "add_simulate_flags",
    "add_strategy",
    "config",
    "layout_options",
    "parse_rate",
    "parse_size",
]

_EPILOG = """\
examples:
  # Megatron-LM 2021 (Narayanan et al., Table 1): 145.6B on 1536 A100 80GB, 8 per node
  torsh-dist plan strategy --params 145.6e9 --layers 80 --hidden 12288 --heads 96 \\
      --devices 1536 --nodes 192 --device-memory 80GB --intra-bw 300GB/s --inter-bw 1600Gbps \\
      --global-batch 2304 --seq-len 2048 --device a100
  # the ZeRO paper's 100B on 400 V100 32GB (25 DGX-2), no pipeline, ZeRO stages 0-2 only
  torsh-dist plan strategy --params 100e9 --layers 125 --hidden 8192 --heads 32 --devices 400 \\
      --nodes 25 --device-memory 32GB --intra-bw 150GB/s --inter-bw 800Gbps --pp 1 \\
      --stages 0,1,2 --device v100 --seq-len 1024 --global-batch 400 --json

sizes: 80GB, 80GiB, 8e10 (bytes); rates: 300GB/s, 800Gbps, 100Gb/s, 3e11 (bytes/s).
--json prints {"inputs", "recommendation", "explanation", "lr_scaling", "candidates": [{"rank",
"name", "dp", "tp", "pp", "ep", "stage", "micro_batch", "microbatches", "recompute", "fits",
"memory_bytes": {...}, "step_time_s": {"compute", "tp_comm", "ep_comm", "pp_comm", "bubble",
"dp_comm", "optimizer", "total"}, "reason"}], "num_candidates", "notes"}.

--profile FILE: a JSON profile of the target machine (Profile.to_dict(); written by
benchmarks/bench_planner.py --save-profile): measured block, non-block, optimizer and collective
times, and what a block and the root cost under FSDP2 (ZeRO-2/3) beyond the plain model, replace
the analytic terms they cover (docs/planner.md, "Profiled mode").
"""

_UNITS = {
    "": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def _number(text: str, what: str, suffix: str) -> float:
    match = re.fullmatch(rf"\s*([0-9.eE+-]+)\s*([kKmMgGtT]i?)?({suffix})?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a {what}: {text!r}")
    try:
        value = float(match.group(1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a {what}: {text!r}") from None
    return value * _UNITS[(match.group(2) or "").lower()]


def parse_size(text: str) -> float:
    """``80GB`` -> 8e10, ``32GiB`` -> 32 * 2**30, a bare number = bytes."""
    return _number(text, "size (e.g. 80GB)", "B")


def parse_rate(text: str) -> float:
    """Bytes/s from ``300GB/s``, ``300GBps``, ``800Gbps`` or ``800Gb/s`` (bits), or bytes/s."""
    bits = re.search(r"b(ps|/s)\s*$", text) is not None
    value = _number(text, "rate (e.g. 300GB/s or 800Gbps)", r"B/s|Bps|b/s|bps")
    return value / 8 if bits else value


def _stages(text: str) -> tuple[int, ...]:
    from torsh_distributed.plan.memory import parse_stages

    try:
        return tuple(parse_stages(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _profile(path: str | None) -> Profile | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            return Profile.from_dict(json.load(f))
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"--profile {path}: {exc}") from None


def config(args: argparse.Namespace) -> StrategyConfig:
    """The :class:`StrategyConfig` of parsed ``plan strategy`` (or ``plan simulate``) flags."""
    return StrategyConfig(
        params=args.params,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        devices=args.devices,
        nodes=args.nodes,
        device_memory=args.device_memory,
        intra_bw=args.intra_bw,
        inter_bw=args.inter_bw,
        intra_latency=args.intra_latency,
        inter_latency=args.inter_latency,
        seq_len=args.seq_len,
        vocab=args.vocab,
        global_batch=args.global_batch,
        dtype=args.dtype,
        optimizer=args.optimizer,
        experts=args.experts,
        top_k=args.top_k,
        device=args.device,
        device_flops=args.device_flops,
        mfu=args.mfu,
        activation_checkpointing=args.activation_checkpointing,
        layout=args.layout,
        flash_attention=args.flash_attention,
        dropout=args.dropout,
        reserve=args.reserve,
        max_micro_batch=args.max_micro_batch,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        stages=args.stages,
        pp_scatter_gather=args.pp_scatter_gather,
        uneven_stages=getattr(args, "uneven_stages", False),
        ref_batch=args.ref_batch,
        ref_lr=args.ref_lr,
        ref_warmup_steps=args.ref_warmup_steps,
        profile=_profile(args.profile),
    )


def _print(plan: StrategyPlan, top: int) -> None:
    cfg = plan.config
    print(
        f"{cfg.params:.4g} parameters, {cfg.layers} layers x {cfg.hidden}, {cfg.devices} devices "
        f"on {cfg.nodes} node(s), {format_bytes(cfg.device_memory)} each, "
        f"{cfg.device_flops / 1e12:.3g} TFLOP/s achieved; global batch {cfg.global_batch} x "
        f"{cfg.seq_len} tokens; {len(plan.candidates)} layouts considered"
    )
    if cfg.profile is not None:
        print(f"profiled: {cfg.profile.source or 'measured profile'} (docs/planner.md)")
    print(f"recommended: {explain(plan)}")
    lr = plan.lr
    scaled = f" -> lr {lr.lr:.3g}" if lr.lr is not None else ""
    warm = f", warm-up {lr.warmup_steps} steps" if lr.warmup_steps is not None else ""
    print(f"learning rate: {lr.rule} (x{lr.factor:.3g}{scaled}{warm}): {lr.reason}")
    for note in plan.notes:
        print(f"note: {note}")
    print(
        "| rank | layout | micro-batch x n | recompute | memory/device | step (s) | compute "
        "| comm (tp/ep/pp/dp) | bubble | optimizer | why not chosen |"
    )
    print("|---:|---|---|---|---:|---:|---:|---|---:|---:|---|")
    shown = plan.candidates[:top]
    shown += [c for c in plan.candidates[top:] if not c.fits][:3]
    for c in shown:
        t, lay = c.estimate.time, c.layout
        comm = "/".join(f"{t[k]:.3g}" for k in ("tp_comm", "ep_comm", "pp_comm", "dp_comm"))
        print(
            f"| {c.rank} | {c.name()} | {lay.micro_batch} x {lay.microbatches} | "
            f"{'yes' if lay.recompute else 'no'} | {format_bytes(c.memory)} | {t['total']:.3g} | "
            f"{t['compute']:.3g} | {comm} | {t['bubble']:.3g} | {t['optimizer']:.3g} | "
            f"{c.reason or 'chosen'} |"
        )


def _simulated(plan: StrategyPlan, args: argparse.Namespace) -> list[dict[str, object]]:
    """``--simulate``: the planner's best candidates re-ranked by the step simulator."""
    from torsh_distributed.plan.simulate import rank_by_simulation

    ranked = rank_by_simulation(
        plan, top=args.simulate_top, explore=args.simulate_explore, **layout_options(args)
    )
    rows = []
    for i, (cand, res) in enumerate(ranked, 1):
        out = res.to_dict()
        del out["critical_path"]
        rows.append(
            {
                "rank": i,
                "name": cand.name(),
                "planner_rank": cand.rank,
                "analytic_step_s": cand.step_time,
                "fits": res.memory["total"] <= plan.config.device_memory,
                **out,
            }
        )
    return rows


def _handle(args: argparse.Namespace) -> int:
    plan = plan_strategy(config(args))
    simulated = _simulated(plan, args) if args.simulate else None
    if args.json:
        out = plan.to_dict(top=args.top)
        if simulated is not None:
            out["simulated"] = simulated
        print(json.dumps(out, indent=2))
        return 0
    _print(plan, args.top)
    if simulated is not None:
        print(f"ranked by the step simulator (the planner's {len(simulated)} best fitting):")
        print(
            "| rank | layout | micro-batch x n | recompute | memory/device | simulated step (s) "
            "| TFLOP/s/device | MFU | analytic step (s) | planner rank |"
        )
        print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|")
        for row in simulated:
            lay = row["layout"]
            print(
                f"| {row['rank']} | {row['name']} | {lay['micro_batch']} x {lay['microbatches']} "
                f"| {lay['recompute']}"
                + (f", interleaved v{lay['interleave']}" if lay["interleave"] > 1 else "")
                + f" | {row['memory_per_device_gb']:.1f} GB"
                f"{'' if row['fits'] else ' (does not fit)'} | {row['step_s']:.4g} "
                f"| {row['tflops_per_device']:.1f} | {row['mfu']:.1%} "
                f"| {row['analytic_step_s']:.4g} | {row['planner_rank']} |"
            )
    return 0


def add_simulate_flags(group: argparse._ArgumentGroup) -> None:
    """How a layout runs (shared by ``plan simulate`` and ``plan strategy --simulate``)."""
    group.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved", "deepspeed"),
        default="1f1b",
        help="pipeline schedule (1f1b; --interleave V > 1 implies interleaved; deepspeed: "
        "DeepSpeed's pipeline engine, blocking paired sends)",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="norms/dropout sharded over tp; all-reduce -> reduce-scatter + all-gather",
    )
    group.add_argument(
        "--dp-overlap",
        action="store_true",
        help="reduce gradient buckets during the last backward (DDP); default after it",
    )
    group.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket, MB (25)")
    group.add_argument(
        "--no-fsdp-prefetch",
        dest="fsdp_prefetch",
        action="store_false",
        help="ZeRO-3: gather each layer only when it is needed",
    )
    group.add_argument("--ffn-hidden", type=int, default=0, help="MLP width (default 4 x --hidden)")
    group.add_argument(
        "--kv-heads", type=int, default=0, help="key/value heads, grouped-query (default --heads)"
    )
    group.add_argument(
        "--gated-mlp", action="store_true", help="SwiGLU MLP: three matrices (Llama)"
    )
    group.add_argument(
        "--topology",
        choices=("rail", "fat-tree"),
        default="rail",
        help="between nodes: rail-optimised (default) or fat-tree with --oversubscription",
    )
    group.add_argument(
        "--oversubscription", type=float, default=1.0, help="fat-tree oversubscription (1)"
    )


def layout_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~torsh_distributed.plan.simulate.SimLayout` fields common to all layouts."""
    return {
        "schedule": args.schedule,
        "sequence_parallel": args.sequence_parallel,
        "dp_overlap": args.dp_overlap,
        "bucket_mb": args.bucket_mb,
        "fsdp_prefetch": args.fsdp_prefetch,
        "ffn_hidden": args.ffn_hidden,
        "kv_heads": args.kv_heads,
        "gated_mlp": args.gated_mlp,
        "topology": args.topology,
        "oversubscription": args.oversubscription,
    }


def add_model_and_cluster(
    p: argparse.ArgumentParser,
) -> tuple[argparse._ArgumentGroup, argparse._ArgumentGroup]:
    """The model, cluster and training flags ``plan strategy`` and ``plan simulate`` share;
    returns the cluster and training groups for each command's own flags."""
    m = p.add_argument_group("model")
    m.add_argument("--params", type=float, required=True, help="parameters (e.g. 175e9)")
    m.add_argument("--layers", type=int, required=True, help="transformer layers")
    m.add_argument("--hidden", type=int, required=True, help="width of the residual stream")
    m.add_argument("--heads", type=int, required=True, help="attention heads")
    m.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (2048)")
    m.add_argument("--vocab", type=int, default=51200, help="vocabulary size (51200)")
    m.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0 = dense)")
    m.add_argument("--top-k", type=int, default=1, help="experts per token (MoE)")
    m.add_argument(
        "--no-flash-attention",
        dest="flash_attention",
        action="store_false",
        help="attention scores are saved for backward (5as bytes per token)",
    )
    m.add_argument("--dropout", action="store_true", help="dropout masks are saved")
    c = p.add_argument_group("cluster")
    c.add_argument("--devices", type=int, required=True, help="accelerators in the job")
    c.add_argument("--nodes", type=int, default=1, help="nodes (devices spread evenly)")
    c.add_argument(
        "--device-memory",
        type=parse_size,
        required=True,
        help="memory per device: 80GB is 80e9 bytes, 80GiB 80 x 2^30 (an 'A100 80GB' has "
        "80GiB, 81920 MiB in nvidia-smi; an 'H100 80GB' 81559 MiB)",
    )
    c.add_argument(
        "--intra-bw",
        type=parse_rate,
        required=True,
        help="per-device bandwidth inside a node, one direction (300GB/s)",
    )
    c.add_argument(
        "--inter-bw",
        type=parse_rate,
        required=True,
        help="bandwidth out of one node, all NICs (1600Gbps)",
    )
    c.add_argument("--intra-latency", type=float, default=5e-6, help="seconds per message (5e-6)")
    c.add_argument("--inter-latency", type=float, default=1e-5, help="seconds per message (1e-5)")
    c.add_argument(
        "--device",
        choices=(*DEVICE_PEAK_FLOPS, "cpu"),
        default="a100",
        help="device kind: its peak FLOP/s and memory bandwidth (a100)",
    )
    c.add_argument(
        "--reserve",
        type=parse_size,
        default=1e9,
        help="memory per device not available to the model (1GB)",
    )
    t = p.add_argument_group("training")
    t.add_argument(
        "--global-batch", type=int, default=0, help="sequences per step (default: one per device)"
    )
    t.add_argument("--dtype", choices=DTYPES, default="bf16", help="bf16 (default), fp16, fp32")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="adam (default), sgd")
    t.add_argument(
        "--layout",
        choices=("paper", "fsdp2"),
        default="paper",
        help="paper (ZeRO paper/DeepSpeed) or fsdp2 (this package) accounting",
    )
    t.add_argument(
        "--pp-scatter-gather",
        action="store_true",
        help="pipeline sends split over tp ranks (Megatron-LM 2021, section 4.1)",
    )
    return c, t


def add_strategy(plan_sub: argparse._SubParsersAction) -> None:
    """Add ``plan strategy`` to the ``plan`` command's subparsers."""
    p = plan_sub.add_parser(
        "strategy",
        help="recommend dp/tp/pp/ep, ZeRO stage, micro-batch and lr rule for a model and cluster",
        description=(
            "Enumerates every layout the constraints allow (dp*tp*pp*ep = devices, tp inside a "
            "node dividing the heads, pp dividing the layers, the global batch divisible by the "
            "replicas' micro-batches), predicts memory per device (ZeRO formulas, activations) "
            "and step time (compute, tp/ep/pp/dp communication by an alpha-beta ring model, "
            "pipeline bubble) and ranks them; see docs/planner.md."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c, t = add_model_and_cluster(p)
    c.add_argument(
        "--device-flops",
        type=float,
        default=0.0,
        help="achieved FLOP/s per device (default: the kind's peak x --mfu)",
    )
    c.add_argument("--mfu", type=float, default=0.5, help="achieved fraction of peak (0.5)")
    c.add_argument(
        "--profile",
        metavar="FILE",
        help="measured profile (JSON) of this model on the target machine; see docs/planner.md",
    )
    t.add_argument(
        "--activation-checkpointing",
        "--ac",
        choices=("auto", "none", "full"),
        default="auto",
        help="auto: recompute only where needed to fit",
    )
    t.add_argument("--max-micro-batch", type=int, default=64, help="largest micro-batch (64)")
    t.add_argument("--tp", type=int, default=0, help="pin tensor parallelism (0 = search)")
    t.add_argument("--pp", type=int, default=0, help="pin pipeline parallelism (0 = search)")
    t.add_argument("--ep", type=int, default=0, help="pin expert parallelism (0 = search)")
    t.add_argument(
        "--stages",
        type=_stages,
        default=(0, 1, 2, 3),
        help="ZeRO stages to consider: 0..3 (default), 0,1,2, ...",
    )
    t.add_argument(
        "--uneven-stages",
        action="store_true",
        help="also pp degrees not dividing --layers (the busiest stage holds ceil(layers/pp))",
    )
    r = p.add_argument_group("learning rate")
    r.add_argument(
        "--ref-batch",
        type=int,
        default=0,
        help="global batch the lr was tuned at (default: --global-batch)",
    )
    r.add_argument("--ref-lr", type=float, help="the tuned lr (to print the scaled one)")
    r.add_argument("--ref-warmup-steps", type=int, default=0, help="the tuned run's warm-up")
    sim = p.add_argument_group("simulation (plan strategy --simulate)")
    sim.add_argument(
        "--simulate",
        action="store_true",
        help="re-rank the best fitting layouts by the step simulator (see plan simulate)",
    )
    sim.add_argument(
        "--simulate-top", type=int, default=20, help="layouts to simulate, in planner order (20)"
    )
    sim.add_argument(
        "--simulate-explore",
        action="store_true",
        help="also try each layout without recomputation, interleaved (every chunk count that "
        "splits its stages evenly, 2 and 4, and (layers + 2) / pp with embedding-only and "
        "head-only end chunks) and at twice its micro-batch, where the simulator's memory says "
        "it fits",
    )
    add_simulate_flags(sim)
    p.add_argument("--top", type=int, default=10, help="rows of the table (10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_handle)
