"""``torsh-dist plan memory``: model-state bytes per rank by the ZeRO paper's formulas.

Pure arithmetic (no process group, no model is built unless ``--preset`` asks for the built-in
model's parameter count); see :mod:`torsh_distributed.plan.memory` for the formulas.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from torsh_distributed.plan.memory import (
    DTYPES,
    LAYOUTS,
    OFFLOADS,
    OPTIMIZERS,
    activation_bytes,
    bytes_per_param,
    format_bytes,
    parse_stages,
    plan_memory,
)

__all__ = ["register"]

_EPILOG = """\
examples:
  torsh-dist plan memory --params 7.5e9 --dp 64 --stage 0..3      # the ZeRO paper's example
  torsh-dist plan memory --params 1.3e9 --dp 8 --stage 3 --dtype fp32 --json
  torsh-dist plan memory --params 7e9 --dp 16 --stage 2,3 --offload cpu
  torsh-dist plan memory --preset small --dp 4 --stage 0..3 --dtype fp32 --batch 8 --layout fsdp2

--json prints, for one stage:
  {"stage": 3, "model_state_bytes_per_rank": {"params", "grads", "optimizer", "total"},
   "host_bytes_per_rank": {...}, "inputs": {...}[, "activation_bytes_per_rank": N]}
and for several stages: {"inputs": {...}, "stages": [<one object per stage as above>]}.
"""

_SHARDED = {0: "nothing (DDP)", 1: "optimizer", 2: "+ gradients", 3: "+ parameters"}


def _model_shape(args: argparse.Namespace) -> dict[str, int] | None:
    if not args.preset:
        return None
    from torsh_distributed.train.config import preset

    model = preset(args.preset).model
    shape = {
        "n_layer": model.n_layer,
        "d_model": model.d_model,
        "n_head": model.n_head,
        "seq_len": model.block_size,
        "vocab_size": model.vocab_size,
    }
    for name in shape:
        value = getattr(args, name, None)
        if value:
            shape[name] = value
    return shape


def _gpt_params(shape: dict[str, int]) -> int:
    import torch

    from torsh_distributed.models.config import ModelConfig
    from torsh_distributed.models.gpt import GPT

    config = ModelConfig(
        vocab_size=shape["vocab_size"],
        block_size=shape["seq_len"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        d_model=shape["d_model"],
    )
    with torch.device("meta"):
        return GPT(config).num_params()


def _handle(args: argparse.Namespace) -> int:
    stages = parse_stages(args.stage)
    shape = _model_shape(args)
    params = args.params or (_gpt_params(shape) if shape else None)
    if not params:
        raise SystemExit(
            "torsh-dist plan memory: give --params N (or --preset for the built-in model)"
        )
    inputs: dict[str, Any] = {
        "params": int(params) if float(params).is_integer() else params,
        "dp": args.dp,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "offload": args.offload,
        "layout": args.layout,
    }
    acts = None
    if shape and args.batch:
        from torsh_distributed.parallel.config import parse_activation_checkpointing

        every = parse_activation_checkpointing(args.ac)
        acts = activation_bytes(
            n_layer=shape["n_layer"],
            d_model=shape["d_model"],
            n_head=shape["n_head"],
            seq_len=shape["seq_len"],
            batch=args.batch,
            vocab_size=shape["vocab_size"],
            checkpointed_layers=len(range(0, shape["n_layer"], every)) if every else 0,
            dtype_bytes=4 if args.dtype == "fp32" else 2,
        )
        inputs.update(shape, batch=args.batch, ac=args.ac)
    plans = [
        plan_memory(
            params,
            args.dp,
            stage,
            dtype=args.dtype,
            optimizer=args.optimizer,
            offload=args.offload,
            layout=args.layout,
        )
        for stage in stages
    ]
    if args.json:
        items = []
        for plan in plans:
            item = plan.to_dict()
            if acts is not None:
                item["activation_bytes_per_rank"] = acts
            items.append(item)
        out = (
            {**items[0], "inputs": inputs}
            if len(items) == 1
            else {"inputs": inputs, "stages": items}
        )
        print(json.dumps(out, indent=2))
        return 0
    p, g, k = bytes_per_param(args.dtype, args.optimizer)
    precision = "fp32" if args.dtype == "fp32" else f"{args.dtype} mixed precision"
    print(
        f"model states per rank: {params:.4g} parameters, dp = {args.dp}, {precision}, "
        f"{args.optimizer} (paper bytes/param: p={p}, g={g}, K={k}), layout {args.layout}, "
        f"offload {args.offload}"
    )
    header = "| stage | sharded | params | grads | optimizer | total per rank |"
    if args.offload != "none":
        header += " on host |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for plan in plans:
        d = plan.device
        row = (
            f"| {plan.stage} | {_SHARDED[plan.stage]} | {format_bytes(d.params)} | "
            f"{format_bytes(d.grads)} | {format_bytes(d.optimizer)} | {format_bytes(d.total)} |"
        )
        if args.offload != "none":
            row += f" {format_bytes(plan.host.total)} |"
        print(row)
    if acts is not None:
        print(f"activations per rank (batch {args.batch}, ac {args.ac}): {format_bytes(acts)}")
    return 0


def _ac(text: str) -> str:
    from torsh_distributed.parallel.config import parse_activation_checkpointing

    try:
        parse_activation_checkpointing(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _stage(text: str) -> str:
    try:
        parse_stages(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``plan`` with its ``memory``, ``strategy``, ``simulate`` and ``profile`` subcommands."""
    plan = sub.add_parser(
        "plan",
        help="plan a run before launching it (memory per rank, parallel strategy, step simulation)",
    )
    plan_sub = plan.add_subparsers(dest="plan_command", metavar="WHAT")
    plan_sub.required = True
    parser = plan_sub.add_parser(
        "memory",
        help="model-state bytes per rank for ZeRO stages 0-3 (the ZeRO paper's formulas)",
        description=(
            "Bytes of parameters, gradients and optimizer state per data-parallel rank for ZeRO "
            "stages 0-3: 0 = DDP, 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters. "
            "Mixed-precision Adam uses K = 12 bytes of optimizer state per parameter (fp32 master, "
            "momentum, variance), fp32 Adam K = 8, SGD with momentum K = 8 mixed / 4 fp32. "
            "Units are decimal (1 GB = 1e9 bytes), as in the paper."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--params", type=float, help="number of parameters (e.g. 7.5e9)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument(
        "--stage",
        type=_stage,
        default="0..3",
        help="ZeRO stage 0-3, a range 0..3, or a list 1,3 (default 0..3: all in one table)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bf16",
        help="fp32, or bf16/fp16 mixed precision (default bf16; same bytes as fp16)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="adam (two moments), sgd (with momentum: one) or sgd-plain (no state)",
    )
    parser.add_argument(
        "--offload",
        choices=OFFLOADS,
        default="none",
        help="cpu: sharded states in host memory (torch's CPUOffloadPolicy; stage 2-3)",
    )
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="paper",
        help="paper (ZeRO paper) or fsdp2 (what this package holds between steps)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    act = parser.add_argument_group("activations of the built-in model (need --preset and --batch)")
    act.add_argument(
        "--preset", choices=("tiny", "small"), help="built-in model shape (and --params)"
    )
    act.add_argument("--batch", type=int, help="sequences per rank per step")
    act.add_argument("--n-layer", dest="n_layer", type=int, help="override the preset's blocks")
    act.add_argument("--d-model", dest="d_model", type=int, help="override the preset's width")
    act.add_argument("--n-head", dest="n_head", type=int, help="override the preset's heads")
    act.add_argument("--seq-len", dest="seq_len", type=int, help="override the preset's context")
    act.add_argument("--vocab-size", dest="vocab_size", type=int, help="override the vocabulary")
    act.add_argument(
        "--ac", type=_ac, default="none", help="activation checkpointing: none, full, every-K"
    )
    parser.set_defaults(handler=_handle)
    from torsh_distributed.cli.plan_profile import add_profile
    from torsh_distributed.cli.plan_simulate import add_simulate
    from torsh_distributed.cli.plan_strategy import add_strategy

    add_strategy(plan_sub)
    add_simulate(plan_sub)
    add_profile(plan_sub)
