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
}


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
            "final_loss": result.final_loss,
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
    print("| layout | parameters | tokens/s | vs dense | all-to-all bytes/step (rank 0) | dropped | load CV | final loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        med = {k: statistics.median(x[k] for x in rows[name]) for k in rows[name][0]}
        print(
            f"| {name} | {int(med['params']):,} | {med['tokens_per_s']:,.0f} | "
            f"{med['tokens_per_s'] / dense:.2f} | {med['a2a_bytes_per_step']:,.0f} | "
            f"{med['dropped']:.1%} | {med['load_cv']:.2f} | {med['final_loss']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
