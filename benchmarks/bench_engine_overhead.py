"""What the engine costs per step over a hand-written DDP loop on the same model and batches.

Both loops train the same user model (``TinyLM`` from ``torsh_distributed.testing.models``) on
the same global batches with DDP and AdamW on 2 ranks; the hand loop does exactly forward,
backward, clip, step. They run alternately in one process group (``--repeats`` rounds, order
flipped every round), so the machine's noise hits both alike, and the table gives the median
step time of each and their ratio (engine / hand).

    python benchmarks/bench_engine_overhead.py --steps 60 --repeats 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from torsh_distributed.testing import run_distributed


def _bench(steps: int, repeats: int, width: int) -> dict[str, list[float]]:
    import torch

    from torsh_distributed.data import EpochSampler, fetch, shard
    from torsh_distributed.engine import Engine, EngineConfig
    from torsh_distributed.engine.engine import default_loss
    from torsh_distributed.parallel import apply_ddp
    from torsh_distributed.runtime import world
    from torsh_distributed.testing.models import TinyLM, token_data

    torch.set_num_threads(1)
    data = token_data(n=4096)
    batch = 32

    def hand() -> float:
        torch.manual_seed(0)
        base = TinyLM(d_model=width)
        model = apply_ddp(base)
        opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
        sampler = EpochSampler(len(data), global_batch=batch, seed=0)
        rank, size = world.rank(), world.world_size()
        start = time.perf_counter()
        for step in range(steps):
            x, y = fetch(data, shard(sampler.indices(step), rank=rank, num_ranks=size))
            opt.zero_grad(set_to_none=True)
            loss = default_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(base.parameters(), 1.0)
            opt.step()
            torch.distributed.all_reduce(loss.detach())  # the engine reports the global loss
        return (time.perf_counter() - start) / steps

    def engine() -> float:
        config = EngineConfig(max_steps=steps, batch_size=batch, progress=False, eval_batches=1)
        config.optim.warmup_steps = 0
        result = Engine(
            lambda: TinyLM(d_model=width),
            dataset=data,
            config=config,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        ).fit()
        return result.wall_time_s / steps, batch / result.samples_per_s

    out: dict[str, list[float]] = {"hand": [], "engine_loop": [], "engine_wall": []}
    for r in range(repeats):
        order = ("hand", "engine") if r % 2 == 0 else ("engine", "hand")
        for which in order:
            if which == "hand":
                out["hand"].append(hand())
            else:
                wall, loop = engine()
                out["engine_loop"].append(loop)
                out["engine_wall"].append(wall)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args(argv)
    res = run_distributed(_bench, 2, args=(args.steps, args.repeats, args.width), timeout=1200)[0]
    hand = statistics.median(res["hand"])
    loop = statistics.median(res["engine_loop"])
    wall = statistics.median(res["engine_wall"])
    print(f"2 ranks, TinyLM d_model={args.width}, {args.steps} steps x {args.repeats} rounds")
    print("| loop | median s/step | ratio to hand |")
    print("|---|---:|---:|")
    print(f"| hand-written DDP loop | {hand * 1e3:.2f} ms | 1.000 |")
    print(f"| engine, training loop | {loop * 1e3:.2f} ms | {loop / hand:.3f} |")
    print(f"| engine, whole fit() incl. setup and final eval | {wall * 1e3:.2f} ms | {wall / hand:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
