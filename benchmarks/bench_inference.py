"""Inference latency and throughput of the built-in GPT, TP=1 vs TP=2, side by side.

The GPT of the ``small`` preset (4 layers, width 128, 4 heads, context 128, byte vocabulary),
fp32, randomly initialised under a fixed seed (the timings do not depend on the weights),
greedy decoding of ``--new-tokens`` tokens from prompts of ``--prompt-len`` random token ids
(fixed seed), through :func:`torsh_distributed.inference.generate_batch`. Variants, each in
fresh processes started by :func:`~torsh_distributed.testing.run_distributed`:

* ``TP=1``: the unsharded model in one process, KV cache;
* ``TP=1, 2 threads``: the same with 2 intra-op threads (the whole 2-core machine);
* ``TP=2``: the model sharded by :func:`~torsh_distributed.models.gpt_tp.gpt_tp_plan` (head
  gathered) over two Gloo processes, KV cache; every rank runs the same calls, rank 0's clock;
* ``TP=1 no cache``: one process, every step a full forward of the whole sequences (batch 1
  only, the reference for what the cache saves).

Each process runs ``--threads`` intra-op threads (default 1: two TP ranks on a 2-core machine
would only contend with more); ``TP=1, 2 threads`` is TP=1 given both cores. The variants run
in ``--rounds`` rounds, the order rotated every round so that the machine's noise hits all
alike; each run first warms up (one short generation per batch size), untimed.

Measured per variant (pooled over the rounds):

* batch 1, ``--latency-reps`` generations a round: time to first token (prefill of the prompt
  and the first sample; ``GenerationResult.time_to_first_token_s``) and time per output token
  (every later decode step, ``token_latencies_s[1:]``), p50 and p99; tokens/s = generated tokens
  / wall time of the ``generate`` call (prefill included);
* batch 8 and 32, ``--throughput-reps`` generations a round: tokens/s = all rows' generated
  tokens / wall time of the ``generate_batch`` call.

The tokens of every variant are compared with TP=1's for the same prompts (batch 1 and every
batch); the flags are printed. A TP rank's clock starts after a barrier, so both ranks enter
each call together. Last, the TP=2 run profiles 10 decode steps (collectives per step, share of
the step spent launching and waiting for them) and times a bare Gloo all-reduce of one token's
activation in a tight loop, for scale.

    python benchmarks/bench_inference.py --rounds 3
    python benchmarks/bench_inference.py --smoke      # seconds: batch 1, 4 new tokens, 1 round
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

from torsh_distributed.testing import run_distributed

# the small preset's model (src/torsh_distributed/train/config.py)
MODEL = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "d_model": 128}
VARIANTS: dict[str, dict[str, Any]] = {
    "TP=1": {"tp": 1, "cache": True},
    "TP=1, 2 threads": {"tp": 1, "cache": True, "threads": 2},
    "TP=2": {"tp": 2, "cache": True},
    "TP=1 no cache": {"tp": 1, "cache": False, "batches": (1,)},
}


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant on this rank (``world_size`` = its tp): timings and tokens."""
    import torch
    import torch.distributed as dist

    from torsh_distributed.inference import SamplingConfig, generate, generate_batch
    from torsh_distributed.models.config import ModelConfig
    from torsh_distributed.models.gpt import GPT

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])  # the same weights in every variant and on every rank
    model = GPT(ModelConfig(**spec["model"]))
    if spec["tp"] > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from torsh_distributed.models.gpt_tp import gpt_tp_plan
        from torsh_distributed.parallel.tp_plan import apply_tp_plan

        mesh = init_device_mesh("cpu", (spec["tp"],))
        model = apply_tp_plan(model, mesh, gpt_tp_plan())
    model.eval()
    prompts: list[list[int]] = spec["prompts"]
    cache: bool = spec["cache"]
    greedy = SamplingConfig(temperature=0, max_new_tokens=spec["new_tokens"])
    warm = SamplingConfig(temperature=0, max_new_tokens=min(4, spec["new_tokens"]))
    for batch in spec["batches"]:
        generate_batch(model, prompts[:batch], warm, cache=cache)

    ttft: list[float] = []
    tpot: list[float] = []
    tps: dict[int, list[float]] = {b: [] for b in spec["batches"]}
    single: dict[int, list[int]] = {}  # prompt index -> tokens at batch 1
    batched: dict[int, list[list[int]]] = {}
    for i in range(spec["latency_reps"]):
        index = i % len(prompts)
        dist.barrier()
        start = time.perf_counter()
        result = generate(model, prompts[index], greedy, cache=cache)
        wall = time.perf_counter() - start
        ttft.append(result.time_to_first_token_s)
        tpot += result.token_latencies_s[1:]
        tps[1].append(len(result.tokens) / wall)
        single[index] = result.tokens
    for batch in spec["batches"]:
        if batch == 1:
            continue
        for _ in range(spec["throughput_reps"]):
            dist.barrier()
            start = time.perf_counter()
            results = generate_batch(model, prompts[:batch], greedy, cache=cache)
            wall = time.perf_counter() - start
            tps[batch].append(sum(len(r.tokens) for r in results) / wall)
            batched[batch] = [r.tokens for r in results]
    comm = (
        _profile_decode_step(model, prompts[0], spec["model"]["d_model"]) if spec["tp"] > 1 else {}
    )
    return {
        "ttft": ttft,
        "tpot": tpot,
        "tps": tps,
        "single": single,
        "batched": batched,
        **comm,
    }


def _profile_decode_step(
    model: Any, prompt: list[int], d_model: int, steps: int = 10
) -> dict[str, Any]:
    """Where a TP decode step's time goes: collectives per step (torch profiler, batch 1) and
    a bare all-reduce of one token's activation in a tight loop, for scale."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from torsh_distributed.inference import KVCache

    cache = KVCache(batch_size=1, max_len=len(prompt) + steps + 1)
    x = torch.tensor([prompt])
    with torch.no_grad():
        model.forward_cached(x, cache)
        dist.barrier()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                model.forward_cached(x[:, -1:], cache)
        wall = time.perf_counter() - start
    events = {e.key: e for e in prof.key_averages()}

    def count(key: str) -> float:
        return events[key].count / steps if key in events else 0.0

    comm_us = sum(
        events[k].cpu_time_total
        for k in (
            "_c10d_functional::all_reduce",
            "_c10d_functional::all_gather_into_tensor",
            "_c10d_functional::wait_tensor",
        )
        if k in events
    )
    bare: list[float] = []
    token = torch.zeros(1, 1, d_model)
    for i in range(220):
        start = time.perf_counter()
        dist.all_reduce(token)
        if i >= 20:
            bare.append(time.perf_counter() - start)
    return {
        "all_reduces_per_step": count("_c10d_functional::all_reduce"),
        "all_gathers_per_step": count("_c10d_functional::all_gather_into_tensor"),
        "profiled_step_s": wall / steps,
        "comm_share": comm_us * 1e-6 / wall,
        "bare_all_reduce": bare,
    }


def _pct(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, linear between order statistics."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--latency-reps", type=int, default=10, help="batch-1 runs per round")
    parser.add_argument("--throughput-reps", type=int, default=2, help="runs per batch per round")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="batch 1, 4 new tokens, 1 round, 2 reps: a quick check"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.new_tokens, args.batches = 1, 4, [1]
        args.latency_reps, args.throughput_reps = 2, 1
    batches = sorted(set(args.batches) | {1})
    if args.prompt_len + args.new_tokens - 1 > MODEL["block_size"]:
        parser.error(f"prompt-len + new-tokens - 1 must fit the context of {MODEL['block_size']}")

    import torch

    gen = torch.Generator().manual_seed(args.seed)
    n_prompts = max(batches)
    prompts = torch.randint(0, MODEL["vocab_size"], (n_prompts, args.prompt_len), generator=gen)
    base = {
        "model": MODEL,
        "seed": args.seed,
        "prompts": prompts.tolist(),
        "new_tokens": args.new_tokens,
        "latency_reps": args.latency_reps,
        "throughput_reps": args.throughput_reps,
        "threads": args.threads,
    }
    names = list(VARIANTS)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    same_ranks = True
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            variant = VARIANTS[name]
            spec = {**base, **variant, "batches": variant.get("batches", batches)}
            spec["threads"] = variant.get("threads", args.threads)
            out = run_distributed(_measure, variant["tp"], args=(spec,), timeout=900)
            same_ranks &= all(
                (o["single"], o["batched"]) == (out[0]["single"], out[0]["batched"]) for o in out
            )
            runs[name].append(out[0])
    elapsed = time.perf_counter() - start
    load_after = os.getloadavg()[0]

    def pooled(name: str, key: str) -> list[float]:
        return [x for run in runs[name] for x in run[key]]

    def tokens(name: str) -> tuple[dict[int, list[int]], dict[int, list[list[int]]]]:
        single: dict[int, list[int]] = {}
        batched: dict[int, list[list[int]]] = {}
        for run in runs[name]:
            single.update(run["single"])
            batched.update(run["batched"])
        return single, batched

    ref_single, ref_batched = tokens("TP=1")
    tp2_single, tp2_batched = tokens("TP=2")
    nc_single, _ = tokens("TP=1 no cache")
    t2_single, t2_batched = tokens("TP=1, 2 threads")
    tp2_equal = tp2_single == ref_single and tp2_batched == ref_batched
    threads_equal = t2_single == ref_single and t2_batched == ref_batched
    nocache_equal = nc_single == {i: ref_single[i] for i in nc_single}
    # batch 1 vs batched at TP=1: the rows of a batch against the same prompts alone
    batch_equal = all(
        rows[i] == ref_single[i]
        for rows in ref_batched.values()
        for i in ref_single
        if i < len(rows)
    )

    print(
        f"GPT {MODEL['n_layer']} layers, d_model {MODEL['d_model']}, {MODEL['n_head']} heads, "
        f"context {MODEL['block_size']}, fp32, random init (seed {args.seed}); greedy, prompt "
        f"{args.prompt_len} tokens, {args.new_tokens} new; {args.threads} thread(s) per "
        f"process unless named; {args.rounds} round(s); {elapsed:.0f} s; load average {load_before:.1f} before, "
        f"{load_after:.1f} after"
    )
    n_ttft = len(pooled("TP=1", "ttft"))
    n_tpot = len(pooled("TP=1", "tpot"))
    print(
        f"\nbatch 1: time to first token ({n_ttft} generations per variant) and time per output "
        f"token ({n_tpot} decode steps per variant), ms"
    )
    print(
        "| variant | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | TPOT p50 vs TP=1 "
        "| TPOT p50 by round, min-max |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    ref_tpot = _pct(pooled("TP=1", "tpot"), 0.5)
    for name in names:
        ttft, tpot = pooled(name, "ttft"), pooled(name, "tpot")
        by_round = [_pct(run["tpot"], 0.5) for run in runs[name]]
        print(
            f"| {name} | {_ms(_pct(ttft, 0.5))} | {_ms(_pct(ttft, 0.99))} | "
            f"{_ms(_pct(tpot, 0.5))} | {_ms(_pct(tpot, 0.99))} | "
            f"{_pct(tpot, 0.5) / ref_tpot:.2f} | {_ms(min(by_round))}-{_ms(max(by_round))} |"
        )

    print(
        "\ngenerated tokens/s, whole batch: median (min-max) of the runs; wall time incl. prefill"
    )
    print("| variant | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for name in names:
        cells = []
        for b in batches:
            values = [x for run in runs[name] for x in run["tps"].get(b, [])]
            cells.append(
                f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"
                if values
                else "-"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")
    if "TP=1" in names and "TP=2" in names:
        ratios = []
        for b in batches:
            one = statistics.median(x for run in runs["TP=1"] for x in run["tps"][b])
            two = statistics.median(x for run in runs["TP=2"] for x in run["tps"][b])
            ratios.append(f"{two / one:.2f}")
        print("| TP=2 / TP=1 | " + " | ".join(ratios) + " |")

    if runs["TP=2"] and "all_reduces_per_step" in runs["TP=2"][0]:
        last = runs["TP=2"][-1]
        bare = pooled("TP=2", "bare_all_reduce")
        print(
            f"\nTP=2 decode step under the torch profiler (rank 0, batch 1, last round): "
            f"{last['all_reduces_per_step']:.0f} all-reduces + {last['all_gathers_per_step']:.0f} "
            f"all-gather per forward (+ 1 token broadcast per step in generate), "
            f"{_ms(last['profiled_step_s'])} ms per step, {last['comm_share']:.0%} of it launching "
            f"and waiting for collectives; a bare Gloo all-reduce of one token's activation "
            f"({MODEL['d_model']} fp32) in a tight loop: p50 {_ms(_pct(bare, 0.5))} ms"
        )
    print(f"TP=2 tokens == TP=1 tokens (batch 1 and every batch): {tp2_equal}")
    print(f"TP=1 2-thread tokens == TP=1 tokens: {threads_equal}")
    print(f"TP=1 no-cache tokens == TP=1 cached tokens (batch 1): {nocache_equal}")
    print(f"TP=1 batched rows == the same prompts at batch 1: {batch_equal}")
    print(f"every TP rank returned the same tokens: {same_ranks}")
    return 0 if same_ranks else 1  # a token flip in fp32 rounding is reported, not fatal


if __name__ == "__main__":
    sys.exit(main())
