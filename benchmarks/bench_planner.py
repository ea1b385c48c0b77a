"""Strategy planner: predicted vs measured memory and step time of 4 layouts on 2 CPU ranks.

The built-in GPT (4 layers, width 384, 4 heads, context 128, fp32 AdamW, global batch
``--batch``, 16 by default) is trained on 2 Gloo ranks (1 thread each) in four layouts, in alternating rounds (order rotated
every round): ``dp2 z0`` (DDP), ``dp2 z3`` (FSDP2), ``tp2`` and ``pp2`` (1F1B, 4 micro-batches).

Before any training run, in processes of their own, micro-benchmarks measure the planner's
:class:`~torsh_distributed.plan.profile.Profile` of this machine (profile-guided planning, as
Alpa, Galvatron and Metis do; nothing is fitted to the runs it predicts, no per-layout factor):

* one transformer block's forward + backward at the layouts' micro-batches (batch / 4, / 2, / 1:
  4, 8 and 16 by default): at tp 1 on each of the 2 ranks at once (as data-parallel replicas
  share the cores) and on one rank while the other waits (a pipeline's fill and drain), at tp 2
  on a 2-rank mesh through the GPT's own TP plan (``gpt_tp_plan``, its all-reduces included);
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
taken from the same micro-benchmarks (FLOP rate of the tp-1 block at dp2's micro-batch, the
all-reduce's alpha and bandwidth). Memory adds the runtime's own peak RSS (a negligible model,
2 blocks of width 8, in the same layout: the equivalent of a GPU's CUDA context).

Measured: peak RSS (max over ranks; glibc's mmap threshold fixed at 64 KiB so RSS tracks live
tensors, see docs/sharding.md; the profile runs under the same setting) and the steady step
time (what the planner predicts): the loop time of the ``--steps`` run minus that of a 1-step
run of the same layout just after it, over ``steps - 1`` (rounds 2 and later: the first round
measures memory, with the null runs, and runs no 1-step runs that would shift their baseline);
the step time over all steps (first included) is printed beside it. Medians over rounds; for
every pair of layouts, in how many rounds their order was the median's (a pair split between
rounds is a tie this machine cannot resolve). Prints the profile and one markdown table. The
workload and the profile's micro-benchmarks are in ``planner_profile.py``.

    python benchmarks/bench_planner.py --rounds 6 --steps 6 [--batch 16] [--save-profile FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Any

from planner_profile import (
    LAYOUTS,
    NULL,
    SHAPE,
    config,
    mallopt,
    measure_profile,
    planner_layouts,
    print_profile,
    runtime_steps,
    steady_step,
    to_profile,
)

from torsh_distributed.plan.strategy import CLOSE
from torsh_distributed.testing import run_distributed


def _round(steps: int, order: list[str], null: bool, batch: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from torsh_distributed.train import train

    mallopt()
    out: dict[str, Any] = {"runs": {}, "null": {}}
    for name in order:
        if null:  # the runtime's own peak in this layout (a negligible model), run just
            # before the measured run, so that it finds the same modules and heap
            base = train(config(name, 2, NULL, batch))
            peak = torch.tensor([float(base.memory["peak_rss_bytes"])])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["null"][name] = float(peak)
        result = train(config(name, steps, SHAPE, batch))
        peak = torch.tensor([float(result.memory["peak_rss_bytes"])])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        steady = None
        if not null:  # not in the memory round: the heap a 1-step run frees would sit in the
            # next null run's baseline. Its loop time is the first step's (one-off allocations,
            # optimizer state creation), which the planner does not model; the rest is steady
            steady = steady_step(batch, steps, result, train(config(name, 1, SHAPE, batch)))
        out["runs"][name] = {
            "step_s": batch / result.samples_per_s,
            "steady_s": steady,
            "peak": float(peak),
            "num_params": result.num_params,
        }
    return out


def _predict(profile: Any, num_params: int, batch: int, *, profiled: bool) -> dict[str, Any]:
    """The planner's predictions of the 4 layouts: profiled, or analytic on a device whose FLOP
    rate and link come from the same micro-benchmarks (one block at tp 1, micro-batch 8; the
    2-rank all-reduce's ``alpha + bytes beta`` = the ring's ``2 alpha' + bytes / bw``)."""
    from torsh_distributed.plan.strategy import StrategyConfig, evaluate_layout

    h, s = SHAPE["d_model"], SHAPE["block_size"]
    block_params = 12 * h * h + 13 * h
    mb = planner_layouts(batch)["dp2 z0"]["micro_batch"]  # the tp-1 block's FLOP rate there
    flops = mb * s * (6 * block_params + 12 * s * h)
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
        global_batch=batch,
        dtype="fp32",
        optimizer="adam",
        device="cpu",
        device_flops=flops / profile.block[1][mb],
        activation_checkpointing="none",
        layout="fsdp2",
        reserve=0,
        profile=profile if profiled else None,
    )
    return {name: evaluate_layout(cfg, **kw) for name, kw in planner_layouts(batch).items()}


def _ranks(values: dict[str, float]) -> dict[str, int]:
    return {name: i for i, name in enumerate(sorted(values, key=values.__getitem__), 1)}


def _pairs(rounds: list[dict[str, Any]], names: list[str]) -> list[str]:
    """For every pair of layouts: in how many rounds the faster one (by median) was faster.

    Rounds run the layouts back to back, so a load change mostly shifts a whole round: a pair
    ordered alike in most rounds is a measured order; a pair split between rounds is a tie the
    benchmark cannot resolve, whatever the medians say.
    """
    med = {n: statistics.median(r["runs"][n]["steady_s"] for r in rounds) for n in names}
    out = []
    for a, b in itertools.combinations(sorted(names, key=med.__getitem__), 2):
        wins = sum(r["runs"][a]["steady_s"] < r["runs"][b]["steady_s"] for r in rounds)
        out.append(f"{a} < {b} in {wins}/{len(rounds)} rounds ({med[b] / med[a] - 1:+.1%})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--profile-passes", type=int, default=3)
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="global batch (a multiple of 4)")
    parser.add_argument("--save-profile", metavar="FILE", help="write the profile as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 2:
        parser.error("--rounds and --steps must be >= 2 (round 1 measures memory only)")
    if args.batch < 4 or args.batch % 4:
        parser.error(
            f"--batch must be a positive multiple of 4 (pp2 runs 4 micro-batches), got {args.batch}"
        )
    names = list(LAYOUTS)
    started = time.perf_counter()
    # 1. the profile: micro-benchmarks in their own processes, before any training run
    raw = run_distributed(
        measure_profile,
        2,
        args=(args.profile_passes, args.profile_repeats, args.batch),
        timeout=1500,
    )[0]
    profile = to_profile(
        raw,
        f"bench_planner micro-benchmarks, 2 Gloo ranks x 1 thread, {args.profile_passes} passes "
        f"x {args.profile_repeats} repeats (medians), {time.strftime('%Y-%m-%d')}",
    )
    profiled_s = time.perf_counter() - started
    if args.save_profile:
        with open(args.save_profile, "w") as f:
            json.dump(profile.to_dict(), f, indent=1)
    # the training loop's own step in each layout, on a negligible model (as memory's baseline)
    runtime = run_distributed(runtime_steps, 2, args=(3, 12, args.batch), timeout=1500)[0]
    # 2. the predictions, written down before the runs they predict
    num_params = _num_params()
    analytic = _predict(profile, num_params, args.batch, profiled=False)
    preds = _predict(profile, num_params, args.batch, profiled=True)
    # 3. the 4 full training runs, in alternating rounds
    rounds = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        round_args = (args.steps, order, r == 0, args.batch)
        rounds.append(run_distributed(_round, 2, args=round_args, timeout=1500)[0])
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
        f"2 ranks x 1 thread, GPT {SHAPE}, {num_params:,} params, global batch {args.batch}, fp32 "
        f"AdamW; profile {profiled_s:.0f} s, then {args.steps} steps x {args.rounds} rounds "
        f"(medians); {time.perf_counter() - started:.0f} s in all"
    )
    print_profile(profile)
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
    resolved = [  # pairs the planner separates by more than its tie band
        (a, b)
        for a, b in itertools.combinations(names, 2)
        if abs(pred_time[a] - pred_time[b]) / min(pred_time[a], pred_time[b]) >= CLOSE
    ]
    agree = sum((pred_time[a] < pred_time[b]) == (meas_time[a] < meas_time[b]) for a, b in resolved)
    print(
        f"pairs predicted more than {CLOSE:.0%} apart ordered as measured: {agree}/{len(resolved)}"
    )
    _print_with_runtime(names, pred_time, runtime, meas_time)
    print("measured order, round by round (rounds 2-):", "; ".join(_pairs(rounds[1:], names)))
    return 0


def _print_with_runtime(
    names: list[str], planner: dict[str, float], runtime: dict[str, float], meas: dict[str, float]
) -> None:
    """The planner's step plus the loop's own step on a negligible model (as memory adds the
    runtime's own peak), against the measured steady step."""
    full = {n: planner[n] + runtime[n] for n in names}
    fr, mr = _ranks(full), _ranks(meas)
    print(
        "| layout | loop on a negligible model | planner + loop | measured steady | error | "
        "predicted rank | measured rank |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        print(
            f"| {n} | {runtime[n] * 1e3:.0f} ms | {full[n] * 1e3:.0f} ms | {meas[n] * 1e3:.0f} ms | "
            f"{(full[n] - meas[n]) / meas[n]:+.0%} | {fr[n]} | {mr[n]} |"
        )
    same = [fr[n] for n in names] == [mr[n] for n in names]
    print(f"ranking with the loop's own step matches: {same}")


def _num_params() -> int:
    from torsh_distributed.models.gpt import GPT

    return GPT(config("dp2 z0", 1, SHAPE, 16).model).num_params()


if __name__ == "__main__":
    sys.exit(main())
