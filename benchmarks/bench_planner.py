"""Strategy planner: predicted vs measured memory and step time of 4 layouts on 2 CPU ranks.

The built-in GPT (4 layers, width 384, 4 heads, context 128, fp32 AdamW, global batch 16) is
trained on 2 Gloo ranks (1 thread each) in four layouts, in alternating rounds (order rotated
every round): ``dp2 z0`` (DDP), ``dp2 z3`` (FSDP2), ``tp2`` and ``pp2`` (1F1B, 4 micro-batches).

Before any training run, in processes of their own, micro-benchmarks measure the planner's
:class:`~torsh_distributed.plan.profile.Profile` of this machine (profile-guided planning, as
Alpa, Galvatron and Metis do; nothing is fitted to the runs it predicts, no per-layout factor):

* one transformer block's forward + backward at micro-batches 4, 8 and 16: at tp 1 on each of
  the 2 ranks at once (as data-parallel replicas share the cores), at tp 2 on a 2-rank mesh
  through the GPT's own TP plan (``gpt_tp_plan``, its all-reduces included);
* the non-block parts (embeddings, final norm, head, loss) the same way;
* one optimizer step (gradient clipping + AdamW as the engine builds it) per parameter on one
  block's parameters: plain (tp 1), on a pipeline stage (tp 1, the engine's model-parallel
  clipping with the norm summed over the 2 ranks), tp shards (tp 2, no foreach, as the engine
  runs it) and FSDP2 shards (ZeRO-3);
* what FSDP2 costs beyond the plain model (Galvatron-style), at ZeRO stages 2 and 3 and the same
  micro-batches: the GPT with one block and with none, plain and parallelised by the engine's
  ``parallelize`` (the block one unit, the root the rest), timed side by side: per block
  (wrapped 1 - wrapped 0) - (plain 1 - plain 0), for the root wrapped 0 - plain 0; hooks,
  copies, re-sharding and collectives included;
* raw Gloo collectives on 2 ranks at 4 kB and 8 MB: all-reduce, reduce-scatter, all-gather and
  one-way send/recv, each fitted as ``alpha + bytes * beta``.

The planner (:func:`~torsh_distributed.plan.strategy.evaluate_layout`, ``layout="fsdp2"``)
predicts the four layouts from the profile, and, beside it, from its analytic model on a device
taken from the same micro-benchmarks (FLOP rate of the tp-1 block at micro-batch 8, the
all-reduce's alpha and bandwidth). Memory adds the runtime's own peak RSS (a negligible model,
2 blocks of width 8, in the same layout: the equivalent of a GPU's CUDA context).

Measured: peak RSS (max over ranks; glibc's mmap threshold fixed at 64 KiB so RSS tracks live
tensors, see docs/sharding.md; the profile runs under the same setting) and the steady step
time (what the planner predicts): the loop time of the ``--steps`` run minus that of a 1-step
run of the same layout just after it, over ``steps - 1`` (rounds 2 and later: the first round
measures memory, with the null runs, and runs no 1-step runs that would shift their baseline);
the step time over all steps (first included) is printed beside it. Medians over rounds. Prints the profile and one markdown table.

    python benchmarks/bench_planner.py --rounds 6 --steps 6 [--save-profile profile.json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

from torsh_distributed.testing import run_distributed

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2 z0": {"zero_stage": 0},
    "dp2 z3": {"zero_stage": 3},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "microbatches": 4},
}
_PLANNER = {  # the same layouts for the planner: degrees, stage, micro-batch (global batch 16)
    "dp2 z0": {"dp": 2, "stage": 0, "micro_batch": 8},
    "dp2 z3": {"dp": 2, "stage": 3, "micro_batch": 8},
    "tp2": {"dp": 1, "tp": 2, "micro_batch": 16},
    "pp2": {"dp": 1, "pp": 2, "micro_batch": 4},
}
SHAPE = {"n_layer": 4, "d_model": 384, "n_head": 4, "block_size": 128}
NULL = {"n_layer": 2, "d_model": 8, "n_head": 2, "block_size": 128}
BATCH = 16
MICRO_BATCHES = (4, 8, 16)  # the layouts' micro-batches (pp2, dp2, tp2)
_M_MMAP_THRESHOLD = -3


def _mallopt() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(_M_MMAP_THRESHOLD, 65536)


def _config(name: str, steps: int, shape: dict[str, int]) -> Any:
    from torsh_distributed.train import TrainConfig, preset

    cfg = preset("tiny").to_dict()
    cfg["model"].update(shape)
    cfg.update(max_steps=steps, batch_size=BATCH, progress=False, eval_batches=1, threads=1)
    cfg["data"]["max_bytes"] = 300_000
    cfg["optim"]["warmup_steps"] = 1
    cfg["parallel"].update(LAYOUTS[name])
    return TrainConfig.from_dict(cfg)


def _timed(fn: Any, repeats: int, reset: Any = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after 2 warm-ups, every rank starting
    together; the slowest rank's median (it sets a collective step's pace)."""
    import torch
    import torch.distributed as dist

    runs = []
    for i in range(repeats + 2):
        if reset is not None:
            reset()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if i >= 2:
            runs.append(time.perf_counter() - start)
    med = torch.tensor([statistics.median(runs)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def _fit(sizes: tuple[int, int], secs: list[float]) -> dict[str, float]:
    """``alpha + bytes * beta`` through two measured sizes."""
    beta = max((secs[1] - secs[0]) / (sizes[1] - sizes[0]), 1e-13)
    return {"alpha": max(secs[0] - sizes[0] * beta, 1e-7), "beta": beta}


def _profile_collectives(repeats: int) -> dict[str, dict[str, float]]:
    """Raw Gloo collectives on 2 ranks, as the layouts call them: all-reduce (DDP buckets),
    reduce-scatter and all-gather of whole tensors (FSDP2), one-way send/recv (pipeline)."""
    import torch
    import torch.distributed as dist

    rank, sizes = dist.get_rank(), (4 << 10, 8 << 20)
    out: dict[str, dict[str, float]] = {}

    def collective(kind: str, nbytes: int) -> Any:
        full = torch.zeros(nbytes // 4)
        half = torch.zeros(nbytes // 8)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(full)
        if kind == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(half, full)
        if kind == "all_gather":
            return lambda: dist.all_gather_into_tensor(full, half)

        def ping_pong() -> None:  # two one-way messages
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            else:
                dist.recv(full, 0)
                dist.send(full, 0)

        return ping_pong

    for kind in ("all_reduce", "reduce_scatter", "all_gather", "p2p"):
        secs = [_timed(collective(kind, n), repeats) for n in sizes]
        if kind == "p2p":
            secs = [t / 2 for t in secs]
        out[kind] = _fit(sizes, secs)
    return out


def _profile_layers(tp: int, repeats: int) -> dict[str, Any]:
    """One block's and the non-block parts' forward + backward per micro-batch, and one
    optimizer step (clipping + AdamW, as the engine runs it) per parameter, at ``tp``: tp 1 on
    each of the 2 ranks at once (as data-parallel replicas share the cores), tp 2 through the
    GPT's own plan on a 2-rank mesh."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from torsh_distributed.comm.dims import ParallelDims
    from torsh_distributed.engine.optim import build_optimizer
    from torsh_distributed.models.gpt import GPT, lm_loss
    from torsh_distributed.models.gpt_tp import gpt_tp_plan
    from torsh_distributed.parallel.tensor import clip_grad_norm_
    from torsh_distributed.parallel.tp_plan import apply_tp_plan

    train_cfg = _config("tp2" if tp > 1 else "dp2 z0", 1, SHAPE)
    model_cfg = dataclasses.replace(train_cfg.model, n_layer=1)
    torch.manual_seed(0)
    gpt = GPT(model_cfg)
    ctx: Any = contextlib.nullcontext
    clip: Any = torch.nn.utils.clip_grad_norm_
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        dims = ParallelDims(tp=tp).build()
        apply_tp_plan(gpt, dims.mesh["tp"], gpt_tp_plan(loss_parallel=True))  # as at pp 1
        ctx, clip = loss_parallel, clip_grad_norm_
    block = gpt.blocks[0]
    seq, width, vocab = model_cfg.block_size, model_cfg.d_model, model_cfg.vocab_size
    out: dict[str, Any] = {"block": {}, "outside": {}}

    def reset() -> None:
        gpt.zero_grad(set_to_none=True)

    for micro in MICRO_BATCHES:
        x = torch.randn(micro, seq, width, requires_grad=True)

        def fwd_bwd(x: Any = x) -> None:
            block(x).sum().backward()

        out["block"][micro] = _timed(fwd_bwd, repeats, reset)
    block_params = list(block.parameters())
    block(torch.randn(MICRO_BATCHES[0], seq, width)).sum().backward()  # gradients to step
    optim = build_optimizer(block, train_cfg.optim)
    if tp > 1:  # the engine's choice: foreach kernels reject DTensor/plain mixes
        for group in optim.param_groups:
            group["foreach"] = False
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in block_params)
    grip = train_cfg.optim.grad_clip

    def step() -> None:
        clip(block_params, grip)
        optim.step()

    out["optimizer"] = _timed(step, repeats) / local
    if tp == 1:  # a pipeline stage: the engine's model-parallel clipping, the norm summed over pp

        def stage_step() -> None:
            clip_grad_norm_(block_params, grip, pp_group=dist.group.WORLD)
            optim.step()

        out["optimizer_pipeline"] = _timed(stage_step, repeats) / local
    gpt.blocks = nn.ModuleList()  # what is left: embeddings, final norm, head, loss
    for micro in MICRO_BATCHES:
        idx = torch.randint(vocab, (micro, seq))

        def outside(idx: Any = idx) -> None:
            with ctx():
                lm_loss(gpt(idx), idx).backward()

        out["outside"][micro] = _timed(outside, repeats, reset)
    return out


def _profile_sharded_optimizer(repeats: int) -> float:
    """Seconds per local parameter of the step on FSDP2 (ZeRO-3) shards of one block."""
    import torch

    from torsh_distributed.comm.dims import ParallelDims
    from torsh_distributed.engine.optim import build_optimizer
    from torsh_distributed.models.gpt import Block
    from torsh_distributed.parallel.sharded import apply_fsdp

    train_cfg = _config("dp2 z3", 1, SHAPE)
    torch.manual_seed(0)
    block = Block(train_cfg.model)
    dims = ParallelDims(dp=2).build()
    apply_fsdp(block, dims.mesh["dp"], stage=3, units=[])
    cfg = train_cfg.model
    block(torch.randn(MICRO_BATCHES[0], cfg.block_size, cfg.d_model)).sum().backward()
    params = list(block.parameters())
    optim = build_optimizer(block, train_cfg.optim)
    local = sum(p.to_local().numel() for p in params)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, train_cfg.optim.grad_clip)
        optim.step()

    return _timed(step, repeats) / local


def _profile_fsdp(repeats: int) -> dict[str, Any]:
    """What a block and the root unit cost under FSDP2 beyond the plain model, per micro-batch,
    at ZeRO stages 2 and 3 (Galvatron-style: the layer timed as the strategy runs it).

    Side by side on the 2-rank group, every model once per repetition: the GPT with one block
    and with none (the root alone), plain (each rank its own replica) and parallelised by the
    engine's own ``parallelize`` (the block one unit, the root the rest). Block overhead =
    (wrapped 1 - wrapped 0) - (plain 1 - plain 0); root overhead = wrapped 0 - plain 0; medians
    of these differences over the repetitions. Hooks, copies into and out of the flat buffers,
    re-sharding and the collectives are all inside them."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn

    from torsh_distributed.comm.dims import ParallelDims
    from torsh_distributed.models.gpt import GPT, lm_loss
    from torsh_distributed.parallel.parallelize import parallelize

    train_cfg = _config("dp2 z3", 1, SHAPE)
    model_cfg = dataclasses.replace(train_cfg.model, n_layer=1)
    dims = ParallelDims(dp=2).build()
    stages = (2, 3)

    def build(blocks: int, stage: int) -> Any:
        torch.manual_seed(0)
        gpt = GPT(model_cfg)
        if not blocks:
            gpt.blocks = nn.ModuleList()
        if stage:
            par = dataclasses.replace(train_cfg.parallel, zero_stage=stage)
            with warnings.catch_warnings():  # the root alone: no blocks to wrap, as intended
                warnings.simplefilter("ignore", UserWarning)
                parallelize(gpt, dims, par)
        return gpt

    models = {(n, st): build(n, st) for st in (0, *stages) for n in (1, 0)}
    out: dict[str, Any] = {"block": {st: {} for st in stages}, "root": {st: {} for st in stages}}
    for micro in MICRO_BATCHES:
        idx = torch.randint(model_cfg.vocab_size, (micro, model_cfg.block_size))
        rows = []  # per repetition, every model once: a load change shifts the whole row
        for i in range(repeats + 2):  # 2 warm-ups (FSDP2's lazy initialisation)
            row = []
            for gpt in models.values():
                gpt.zero_grad(set_to_none=True)
                dist.barrier()
                start = time.perf_counter()
                lm_loss(gpt(idx), idx).backward()
                row.append(time.perf_counter() - start)
            if i >= 2:
                rows.append(row)
        secs = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(secs, op=dist.ReduceOp.MAX)  # the slowest rank sets a collective's pace
        t = {key: secs[:, j] for j, key in enumerate(models)}
        plain_block = t[1, 0] - t[0, 0]
        for st in stages:  # medians of the paired differences; noise can make one negative
            block = statistics.median((t[1, st] - t[0, st] - plain_block).tolist())
            out["block"][st][micro] = max(0.0, block)
            out["root"][st][micro] = max(0.0, statistics.median((t[0, st] - t[0, 0]).tolist()))
    return out


def _profile(passes: int, repeats: int) -> dict[str, Any]:
    """The planner's profile of this machine: micro-benchmarks only, no training run. Every
    quantity is measured in each of ``passes`` passes (medians over them), so that a change of
    the machine's load shifts them all alike."""
    import torch

    _mallopt()  # the allocator as in the training runs (every tensor > 64 KiB mmapped)
    torch.set_num_threads(1)
    runs = []
    for _ in range(passes):
        runs.append(
            {
                "collectives": _profile_collectives(repeats),
                "layers": {tp: _profile_layers(tp, repeats) for tp in (1, 2)},
                "optimizer_sharded": _profile_sharded_optimizer(repeats),
                "fsdp": _profile_fsdp(repeats),
            }
        )

    def med(path: tuple[Any, ...]) -> float:
        values = []
        for run in runs:
            for key in path:
                run = run[key]
            values.append(run)
        return statistics.median(values)

    coll = {
        k: {p: med(("collectives", k, p)) for p in ("alpha", "beta")}
        for k in runs[0]["collectives"]
    }
    layers = {
        tp: {
            "block": {b: med(("layers", tp, "block", b)) for b in MICRO_BATCHES},
            "outside": {b: med(("layers", tp, "outside", b)) for b in MICRO_BATCHES},
            "optimizer": med(("layers", tp, "optimizer")),
        }
        for tp in (1, 2)
    }
    fsdp = {
        part: {
            st: {b: med(("fsdp", part, st, b)) for b in MICRO_BATCHES}
            for st in runs[0]["fsdp"][part]
        }
        for part in ("block", "root")
    }
    return {
        "collectives": coll,
        "layers": layers,
        "optimizer_sharded": med(("optimizer_sharded",)),
        "optimizer_pipeline": med(("layers", 1, "optimizer_pipeline")),
        "fsdp": fsdp,
    }


def _to_profile(raw: dict[str, Any], source: str) -> Any:
    from torsh_distributed.plan.profile import Collective, Profile

    layers = raw["layers"]
    return Profile(
        hidden=SHAPE["d_model"],
        seq_len=SHAPE["block_size"],
        ranks=2,
        block={tp: dict(v["block"]) for tp, v in layers.items()},
        outside={tp: dict(v["outside"]) for tp, v in layers.items()},
        optimizer={tp: v["optimizer"] for tp, v in layers.items()},
        optimizer_sharded=raw["optimizer_sharded"],
        optimizer_pipeline=raw["optimizer_pipeline"],
        fsdp_block=raw["fsdp"]["block"],
        fsdp_root=raw["fsdp"]["root"],
        **{k: Collective(**v) for k, v in raw["collectives"].items()},
        source=source,
    )


def _round(steps: int, order: list[str], null: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from torsh_distributed.train import train

    _mallopt()
    out: dict[str, Any] = {"runs": {}, "null": {}}
    for name in order:
        if null:  # the runtime's own peak in this layout (a negligible model), run just
            # before the measured run, so that it finds the same modules and heap
            base = train(_config(name, 2, NULL))
            peak = torch.tensor([float(base.memory["peak_rss_bytes"])])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["null"][name] = float(peak)
        result = train(_config(name, steps, SHAPE))
        peak = torch.tensor([float(result.memory["peak_rss_bytes"])])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        steady = None
        if not null:  # not in the memory round: the heap a 1-step run frees would sit in the
            # next null run's baseline. Its loop time is the first step's (one-off allocations,
            # optimizer state creation), which the planner does not model; the rest is steady
            first = BATCH / train(_config(name, 1, SHAPE)).samples_per_s
            steady = (BATCH * steps / result.samples_per_s - first) / (steps - 1)
        out["runs"][name] = {
            "step_s": BATCH / result.samples_per_s,
            "steady_s": steady,
            "peak": float(peak),
            "num_params": result.num_params,
        }
    return out


def _predict(profile: Any, num_params: int, *, profiled: bool) -> dict[str, Any]:
    """The planner's predictions of the 4 layouts: profiled, or analytic on a device whose FLOP
    rate and link come from the same micro-benchmarks (one block at tp 1, micro-batch 8; the
    2-rank all-reduce's ``alpha + bytes beta`` = the ring's ``2 alpha' + bytes / bw``)."""
    from torsh_distributed.plan.strategy import StrategyConfig, evaluate_layout

    h, s = SHAPE["d_model"], SHAPE["block_size"]
    block_params = 12 * h * h + 13 * h
    flops = 8 * s * (6 * block_params + 12 * s * h)
    ar = profile.all_reduce
    cfg = StrategyConfig(
        params=num_params,
        layers=SHAPE["n_layer"],
        hidden=h,
        heads=SHAPE["n_head"],
        seq_len=s,
        vocab=256,
        devices=2,
        nodes=1,
        device_memory=24e9,
        intra_bw=1 / ar.beta,
        inter_bw=1 / ar.beta,
        intra_latency=ar.alpha / 2,
        inter_latency=ar.alpha / 2,
        global_batch=BATCH,
        dtype="fp32",
        optimizer="adam",
        device="cpu",
        device_flops=flops / profile.block[1][8],
        activation_checkpointing="none",
        layout="fsdp2",
        reserve=0,
        profile=profile if profiled else None,
    )
    return {name: evaluate_layout(cfg, **kw) for name, kw in _PLANNER.items()}


def _ranks(values: dict[str, float]) -> dict[str, int]:
    return {name: i for i, name in enumerate(sorted(values, key=values.__getitem__), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--profile-passes", type=int, default=3)
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--save-profile", metavar="FILE", help="write the profile as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 2:
        parser.error("--rounds and --steps must be >= 2 (round 1 measures memory only)")
    names = list(LAYOUTS)
    started = time.perf_counter()
    # 1. the profile: micro-benchmarks in their own processes, before any training run
    raw = run_distributed(
        _profile, 2, args=(args.profile_passes, args.profile_repeats), timeout=1500
    )[0]
    profile = _to_profile(
        raw,
        f"bench_planner micro-benchmarks, 2 Gloo ranks x 1 thread, {args.profile_passes} passes "
        f"x {args.profile_repeats} repeats (medians), {time.strftime('%Y-%m-%d')}",
    )
    profiled_s = time.perf_counter() - started
    if args.save_profile:
        with open(args.save_profile, "w") as f:
            json.dump(profile.to_dict(), f, indent=1)
    # 2. the predictions, written down before the runs they predict
    num_params = _num_params()
    analytic = _predict(profile, num_params, profiled=False)
    preds = _predict(profile, num_params, profiled=True)
    # 3. the 4 full training runs, in alternating rounds
    rounds = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        rounds.append(run_distributed(_round, 2, args=(args.steps, order, r == 0), timeout=1500)[0])
    null = rounds[0]["null"]
    measured = {
        n: {k: statistics.median(x["runs"][n][k] for x in rounds) for k in ("step_s", "peak")}
        for n in names
    }
    for n in names:  # round 0 measures memory and has no 1-step runs
        measured[n]["steady_s"] = statistics.median(x["runs"][n]["steady_s"] for x in rounds[1:])
    assert rounds[0]["runs"]["dp2 z0"]["num_params"] == num_params
    pred_time = {n: preds[n].step_time for n in names}
    meas_time = {n: measured[n]["steady_s"] for n in names}
    all_ranks = _ranks({n: measured[n]["step_s"] for n in names})
    pr, ar, mr = (
        _ranks(pred_time),
        _ranks({n: analytic[n].step_time for n in names}),
        _ranks(meas_time),
    )
    print(
        f"2 ranks x 1 thread, GPT {SHAPE}, {num_params:,} params, global batch {BATCH}, fp32 "
        f"AdamW; profile {profiled_s:.0f} s, then {args.steps} steps x {args.rounds} rounds "
        f"(medians); {time.perf_counter() - started:.0f} s in all"
    )
    _print_profile(profile)
    print(
        "| layout | predicted memory (runtime + planner) | measured peak RSS | error | planner "
        "only | measured - runtime | error | analytic step | profiled step (compute / comm / "
        "bubble / optimizer) | measured steady step (all steps) | error | predicted rank "
        "(analytic, profiled) | measured rank (all steps) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for n in names:
        c = preds[n]
        t = c.estimate.time
        comm = t["tp_comm"] + t["pp_comm"] + t["dp_comm"]
        pred_mem = null[n] + c.memory
        meas = measured[n]["peak"]
        print(
            f"| {n} | {pred_mem / 1e6:.1f} MB | {meas / 1e6:.1f} MB | "
            f"{(pred_mem - meas) / meas:+.1%} | {c.memory / 1e6:.1f} MB | "
            f"{(meas - null[n]) / 1e6:.1f} MB | {(c.memory - meas + null[n]) / (meas - null[n]):+.1%} | "
            f"{analytic[n].step_time * 1e3:.0f} ms | "
            f"{t['total'] * 1e3:.0f} ms ({t['compute'] * 1e3:.0f} / {comm * 1e3:.0f} / "
            f"{t['bubble'] * 1e3:.0f} / {t['optimizer'] * 1e3:.0f}) | {meas_time[n] * 1e3:.0f} ms "
            f"({measured[n]['step_s'] * 1e3:.0f} ms) | "
            f"{(t['total'] - meas_time[n]) / meas_time[n]:+.0%} | {ar[n]}, {pr[n]} | "
            f"{mr[n]} ({all_ranks[n]}) |"
        )
    same = [pr[n] for n in names] == [mr[n] for n in names]
    print(f"ranking by steady step time matches (profiled): {same}")
    return 0


def _num_params() -> int:
    from torsh_distributed.models.gpt import GPT

    return GPT(_config("dp2 z0", 1, SHAPE).model).num_params()


def _print_profile(profile: Any) -> None:
    """One line per profiled quantity (milliseconds; links as alpha and GB/s)."""
    for tp in sorted(profile.block):
        blocks = ", ".join(f"mb{b} {t * 1e3:.0f}" for b, t in profile.block[tp].items())
        outside = ", ".join(f"mb{b} {t * 1e3:.1f}" for b, t in profile.outside[tp].items())
        print(
            f"profile tp{tp}: block fwd+bwd {blocks} ms; outside the blocks {outside} ms; "
            f"optimizer {profile.optimizer[tp] * 1e9:.2f} ns/param"
        )
    print(
        f"profile ZeRO-3 shards: optimizer {profile.optimizer_sharded * 1e9:.2f} ns/param; "
        f"pipeline stage (tp1): optimizer {profile.optimizer_pipeline * 1e9:.2f} ns/param"
    )
    for st in sorted(profile.fsdp_block):
        blocks = ", ".join(f"mb{b} {t * 1e3:.1f}" for b, t in profile.fsdp_block[st].items())
        root = ", ".join(f"mb{b} {t * 1e3:.1f}" for b, t in profile.fsdp_root[st].items())
        print(f"profile FSDP2 ZeRO-{st} beyond plain: per block {blocks} ms; root {root} ms")
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "p2p"):
        c = getattr(profile, kind)
        print(f"profile {kind}: {c.alpha * 1e6:.0f} us + {1 / c.beta / 1e9:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
