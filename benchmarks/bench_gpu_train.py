"""The engine vs a plain PyTorch loop of the same model on one GPU: tokens/s and MFU, side by side
in one process, for fp32 and bf16, eager and ``torch.compile``.

Both train the built-in GPT (``--layers``, ``--width``, ``--heads``, context ``--context``, byte
vocabulary) on the same random token batches (``--batch`` sequences) with AdamW and gradient
clipping at 1.0. The engine runs through :class:`~torsh_distributed.engine.Engine` on NCCL at world
size 1 (its DDP wrapper, monitor, scheduler and loss reduction included); the plain loop is what a
user writes for one GPU: forward under ``torch.autocast`` for bf16, backward, clip, step, and
``loss.item()`` every step (the engine also reads the loss every step). Compile: the engine's
``parallel.compile`` (each block) and ``torch.compile`` of each block in the plain loop.

Each variant runs ``--warmup`` + ``--steps`` steps; the time of the last ``--steps`` is measured (the
engine: from the collate call of the first measured step to the one after the last, which its
per-step loss read makes a synchronised point). MFU = (6 N + 12 L d T) tokens/s / peak, N the
parameters without embeddings, with the dense peak of the device's bf16 (bf16 runs) or fp32 /
TF32 (fp32 runs, per ``torch.backends.cuda.matmul.allow_tf32``) from a table of known devices.
Variants run in the order given; the JSON is rewritten after every variant::

    python benchmarks/bench_gpu_train.py --json bench-train.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# dense peak FLOP/s (bf16, tf32, fp32) by device-name fragment (NVIDIA data sheets, SXM parts)
PEAKS = {
    "H100": (989.4e12, 494.7e12, 66.9e12),
    "H200": (989.4e12, 494.7e12, 66.9e12),
    "A100": (312e12, 156e12, 19.5e12),
}


def _peak(name: str, dtype: str, tf32: bool) -> float | None:
    for key, (bf16, tf, fp32) in PEAKS.items():
        if key in name:
            return bf16 if dtype == "bf16" else (tf if tf32 else fp32)
    return None


def _variant(args: argparse.Namespace, dtype: str, compiled: bool) -> dict:
    import torch

    from torsh_distributed.models.config import ModelConfig

    device = torch.device("cuda", torch.cuda.current_device())
    mcfg = ModelConfig(vocab_size=256, block_size=args.context, n_layer=args.layers,
                       n_head=args.heads, d_model=args.width)
    total = args.warmup + args.steps
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.batch * total, args.context + 1), generator=g)
    dataset = [(row[:-1], row[1:]) for row in data]

    def flops_per_token(model: torch.nn.Module) -> float:
        n = sum(p.numel() for name, p in model.named_parameters() if "emb" not in name)
        return 6 * n + 12 * args.layers * args.width * args.context

    def plain() -> tuple[float, float]:
        return _plain(args, mcfg, data, device, dtype, compiled, flops_per_token)

    def engine() -> tuple[float, str]:
        return _engine(args, mcfg, dataset, dtype, compiled)

    plain_times, engine_times, backend, fpt = [], [], "", 0.0
    for r in range(args.rounds):  # order flipped every round; the fastest round of each kept
        for which in ("plain", "engine") if r % 2 == 0 else ("engine", "plain"):
            if which == "plain":
                step_s, fpt = plain()
                plain_times.append(step_s)
            else:
                step_s, backend = engine()
                engine_times.append(step_s)
            torch.cuda.empty_cache()
    plain_s, engine_s = min(plain_times), min(engine_times)
    tokens = args.batch * args.context
    name = torch.cuda.get_device_name(device)
    peak = _peak(name, dtype, torch.backends.cuda.matmul.allow_tf32)
    out = {"dtype": dtype, "compile": compiled, "tokens_per_step": tokens,
           "plain_step_s": plain_s, "engine_step_s": engine_s,
           "plain_rounds_s": plain_times, "engine_rounds_s": engine_times,
           "plain_tokens_per_s": tokens / plain_s, "engine_tokens_per_s": tokens / engine_s,
           "engine_over_plain": plain_s / engine_s, "flops_per_token": fpt,
           "engine_backend": backend,
           "cuda_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
    if peak:
        out["plain_mfu"] = fpt * tokens / plain_s / peak
        out["engine_mfu"] = fpt * tokens / engine_s / peak
        out["peak_flops"] = peak
    return out


def _plain(args, mcfg, data, device, dtype, compiled, flops_per_token):  # noqa: ANN001, ANN202
    """The plain loop: seconds per measured step, FLOPs per token."""
    import torch
    import torch.nn.functional as F

    from torsh_distributed.models.gpt import GPT

    total = args.warmup + args.steps
    torch.manual_seed(0)
    model = GPT(mcfg).to(device)
    if compiled:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dtype == "bf16" else None
    marks = []
    for step in range(total):
        if step == args.warmup:
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
        rows = data[step * args.batch:(step + 1) * args.batch].to(device, non_blocking=True)
        x, y = rows[:, :-1], rows[:, 1:]
        opt.zero_grad(set_to_none=True)
        if ctx is not None:
            with ctx():
                logits = model(x)
        else:
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
    torch.cuda.synchronize()
    return (time.perf_counter() - marks[0]) / args.steps, flops_per_token(model)


def _engine(args, mcfg, dataset, dtype, compiled):  # noqa: ANN001, ANN202
    """The engine: seconds per measured step, backend."""
    import torch

    from torsh_distributed.engine import Engine, EngineConfig
    from torsh_distributed.models.gpt import GPT

    total = args.warmup + args.steps
    stamps: list[float] = []

    def collate(items: list) -> tuple:
        stamps.append(time.perf_counter())
        return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])

    config = EngineConfig(max_steps=total, batch_size=args.batch, progress=False,
                          eval_batches=1, log_every=10**6)
    config.optim.warmup_steps = 0
    config.parallel.param_dtype = dtype
    config.parallel.compile = compiled
    config.energy.meter = "off"
    torch.manual_seed(0)
    result = Engine(
        lambda: GPT(mcfg), dataset=dataset, config=config, collate_fn=collate,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01),
        blocks="blocks", tokens_per_sample=args.context,
    ).fit()
    # stamps: one per training step, then the evaluation's batches; with the engine's prefetch
    # the stamp of step k+1 is taken while step k's kernels run: the differences still give the
    # steady step time (one stamp per step, each at the same point of the loop)
    return (stamps[total - 1] - stamps[args.warmup]) / (args.steps - 1), result.backend


def _worker(args: argparse.Namespace) -> list[dict]:
    import torch

    rows = []
    for spec in args.variants.split(","):
        dtype, _, mode = spec.partition(":")
        t0 = time.perf_counter()
        row = _variant(args, dtype, mode == "compile")
        row["variant_wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            _write(args, rows, torch.cuda.get_device_name(0))
    return rows


def _write(args: argparse.Namespace, rows: list[dict], device: str) -> None:
    import torch

    path = Path(args.json)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"device": device, "torch": torch.__version__,
                               "model": {"layers": args.layers, "width": args.width,
                                         "heads": args.heads, "context": args.context,
                                         "batch": args.batch},
                               "steps": args.steps, "warmup": args.warmup, "rows": rows},
                              indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2,
                        help="plain and engine alternate this many times per variant (best kept)")
    parser.add_argument("--variants", default="fp32:eager,bf16:eager,bf16:compile",
                        help="comma-separated DTYPE:MODE, DTYPE fp32/bf16, MODE eager/compile")
    parser.add_argument("--json", default="", help="write the results here (after each variant)")
    args = parser.parse_args(argv)
    for spec in args.variants.split(","):
        dtype, _, mode = spec.partition(":")
        if dtype not in ("fp32", "bf16") or mode not in ("eager", "compile"):
            parser.error(f"--variants: {spec!r} is not DTYPE:MODE (fp32/bf16 : eager/compile)")
    if args.steps < 2 or args.warmup < 1:
        parser.error("--steps must be at least 2 and --warmup at least 1")
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_train: needs CUDA (none here)", file=sys.stderr)
        return 2
    from torsh_distributed.testing import run_distributed

    rows = run_distributed(_worker, 1, args=(args,), backend="nccl", timeout=3600)[0]
    for r in rows:
        print(f"{r['dtype']:>4} {'compile' if r['compile'] else 'eager':>7}: plain "
              f"{r['plain_tokens_per_s']:,.0f} tok/s, engine {r['engine_tokens_per_s']:,.0f} tok/s "
              f"(engine/plain {r['engine_over_plain']:.3f}; MFU {r.get('engine_mfu', float('nan')):.3f}"
              f" vs {r.get('plain_mfu', float('nan')):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
