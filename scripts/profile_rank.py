"""Where one rank's CPU goes in a short ``torsh-dist train`` run (docs/testing.md, twenty-fourth
session: how the per-step sub-mesh and the per-rank ``torch._dynamo`` import were found).

Runs the built-in trainer on ``--ranks`` harness ranks (``torsh_distributed.testing``) with
cProfile around ``train()`` on every rank and prints rank 0's CPU seconds and its top functions::

    .venv/bin/python scripts/profile_rank.py --preset tiny --steps 200 --sort cumulative --top 60
    .venv/bin/python scripts/profile_rank.py --backend gloo+shm --zero-stage 3 --sort tottime

The first run in a process also pays its imports (they show up under ``builtins.exec``).
"""

from __future__ import annotations

import argparse


def _profiled(preset: str, steps: int, zero_stage: int, sort: str, top: int) -> tuple[float, str]:
    import cProfile
    import io
    import pstats
    import time

    from torsh_distributed.train import preset as make_preset
    from torsh_distributed.train import train

    cfg = make_preset(preset)
    cfg.max_steps, cfg.batch_size, cfg.progress, cfg.eval_batches = steps, 8, False, 1
    cfg.parallel.zero_stage = zero_stage
    profile = cProfile.Profile()
    start = time.process_time()
    profile.enable()
    train(cfg)
    profile.disable()
    cpu = time.process_time() - start
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(sort).print_stats(top)
    return cpu, text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="gloo+shm", help="gloo or gloo+shm (what auto picks)")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--sort", default="cumulative", help="a pstats key: cumulative, tottime")
    parser.add_argument("--top", type=int, default=50)
    args = parser.parse_args()

    from torsh_distributed.testing import run_distributed

    results = run_distributed(
        _profiled, args.ranks, timeout=1800, backend=args.backend,
        args=(args.preset, args.steps, args.zero_stage, args.sort, args.top),
    )  # fmt: skip
    print("CPU-s per rank:", [round(cpu, 2) for cpu, _ in results])
    print(results[0][1])


if __name__ == "__main__":
    main()
