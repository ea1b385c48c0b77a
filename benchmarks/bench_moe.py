"""MoE vs dense at equal active parameters, side by side: tokens/s, all-to-all bytes, drops, load.

The built-in GPT (2 layers, width 64, context 64, global batch 32) on 2 Gloo ranks, in rounds
that alternate the layouts (order rotated every round, so the machine's noise hits all alike):

* ``dense``: the plain MLP (4 x d_model hidden), DDP over 2 ranks;
* ``moe ep1``: every MLP an MoE of 4 experts, top-1, each expert as wide as the dense MLP, so a
  token runs the same FFN parameters as in the dense model (plus the router): DDP over 2 ranks;
* ``moe ep2``: the same with the experts sharded over 2 ranks (tokens exchanged by all-to-all);
* ``moe ep2 cf1.0``: with capacity factor 1.0 (tokens over an expert's capacity are dropped).

All-to-all bytes are measured by the collectives profiler (every byte the dispatch sent and
received through the facade, forward and backward). Tokens/s is the engine's loop throughput.
``ep load CV`` is the coefficient of variation of the slots each ep rank computed.

A second table measures the expert rebalancer on a deliberately skewed router
(:class:`~torsh_distributed.testing.models.SkewedMoENet`, top-2: every token goes to experts 0 and 1,
both on ep rank 0), ep=2 with ZeRO-3 (FSDP2 over the dense parameters), with and without
``ep_rebalance_every``, alternating in rounds: samples/s, the ranks' load CV and whether the
losses are identical.

    python benchmarks/bench_moe.py --steps 40 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from torsh_distributed.testing import run_distributed

LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dense": ({}, {}),
    "moe ep1": ({}, {"num_experts": 4, "top_k": 1}),
    "moe ep2": ({"ep": 2}, {"num_experts": 4, "top_k": 1}),
    "moe ep2 cf1.0": ({"ep": 2}, {"num_experts": 4, "top_k": 1, "capacity_factor": 1.0}),
    "moe ep2 zero3": ({"ep": 2, "zero_stage": 3}, {"num_experts": 4, "top_k": 1}),
}
SKEWED = {"no rebalancing": 0, "rebalance every 5 steps": 5}


def _round(steps: int, order: list[str]) -> dict[str, dict[str, float]]:
    from torsh_distributed.comm import profiler
    from torsh_distributed.train import TrainConfig, preset, train

    out = {}
    for name in order:
        parallel, moe = LAYOUTS[name]
        cfg = preset("tiny").to_dict()
        cfg.update(max_steps=steps, progress=False, eval_batches=1)
        cfg["parallel"].update(parallel)
        cfg["moe"].update(moe)
        profiler.enable()
        result = train(TrainConfig.from_dict(cfg))
        prof = profiler.disable()
        a2a = sum(r["bytes"] for r in prof.summary() if r["op"] == "all_to_all_single") if prof else 0
        out[name] = {
            "tokens_per_s": result.tokens_per_s,
            "params": result.num_params,
            "a2a_bytes_per_step": a2a / steps,
            "dropped": result.moe.get("dropped_share", 0.0),
            "load_cv": result.moe.get("load_cv", 0.0),
            "ep_load_cv": result.moe.get("ep_load_cv", 0.0),
            "final_loss": result.final_loss,
        }
    return out


def _skewed_round(steps: int, order: list[str]) -> dict[str, dict[str, Any]]:
    from torsh_distributed.engine import Engine
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.parallel.config import ParallelConfig
    from torsh_distributed.testing import models as M

    out: dict[str, dict[str, Any]] = {}
    for name in order:
        config = EngineConfig(
            max_steps=steps,
            batch_size=256,
            progress=False,
            optim=OptimConfig(lr=1e-3, warmup_steps=0),
            parallel=ParallelConfig(ep=2, zero_stage=3, ep_rebalance_every=SKEWED[name]),
        )
        result = Engine(
            lambda: M.SkewedMoENet(d_in=64, d_model=256, d_hidden=1024, top_k=2),
            dataset=M.classification_data(n=4096, d_in=64),
            config=config,
        ).fit()
        rebalance = result.moe["rebalance"] or {}
        out[name] = {
            "samples_per_s": result.samples_per_s,
            "ep_load_cv": result.moe["ep_load_cv"],
            "per_rank": result.moe["per_layer"][0]["tokens_per_ep_rank"],
            "moves": rebalance.get("moves", 0),
            "losses": result.losses,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    names = list(LAYOUTS)
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        res = run_distributed(_round, 2, args=(args.steps, order), timeout=1200)[0]
        for name in names:
            rows[name].append(res[name])
    dense = statistics.median(x["tokens_per_s"] for x in rows["dense"])
    print(f"2 ranks, tiny GPT, {args.steps} steps x {args.rounds} rounds (medians)")
    print(
        "| layout | parameters | tokens/s | vs dense | all-to-all bytes/step (rank 0) | dropped "
        "| expert load CV | ep load CV | final loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        med = {k: statistics.median(x[k] for x in rows[name]) for k in rows[name][0]}
        print(
            f"| {name} | {int(med['params']):,} | {med['tokens_per_s']:,.0f} | "
            f"{med['tokens_per_s'] / dense:.2f} | {med['a2a_bytes_per_step']:,.0f} | "
            f"{med['dropped']:.1%} | {med['load_cv']:.2f} | {med['ep_load_cv']:.2f} | "
            f"{med['final_loss']:.3f} |"
        )
    skewed(args.steps, args.rounds)
    return 0


def skewed(steps: int, rounds: int) -> None:
    """The rebalancer table (see the module docstring)."""
    names = list(SKEWED)
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        res = run_distributed(_skewed_round, 2, args=(steps, order), timeout=1200)[0]
        for name in names:
            rows[name].append(res[name])
    base = statistics.median(x["samples_per_s"] for x in rows[names[0]])
    same = all(a["losses"] == b["losses"] for a, b in zip(*rows.values(), strict=True))
    print(f"\nskewed router, ep 2 + ZeRO-3, {steps} steps x {rounds} rounds (medians)")
    print("| run | samples/s | vs no rebalancing | slots per ep rank | ep load CV | moves |")
    print("|---|---:|---:|---|---:|---:|")
    for name in names:
        med = statistics.median(x["samples_per_s"] for x in rows[name])
        last = rows[name][-1]
        print(
            f"| {name} | {med:,.0f} | {med / base:.2f} | {last['per_rank']} | "
            f"{last['ep_load_cv']:.2f} | {last['moves']} |"
        )
    print(f"losses identical with and without rebalancing: {same}")


if __name__ == "__main__":
    sys.exit(main())
