"""Loss fingerprints of the built-in trainer under every layout: before/after figures of a refactor.

Runs the trainer (``small_config``: 4 layers, width 32, 8 steps) in each layout on local ranks and
prints one JSON object ``{layout: [loss per step]}``. Run it on two commits and compare with
``--compare OTHER.json``: a refactor that changes no computation prints a max |difference| of 0.

    python benchmarks/bench_engine_parity.py --out after.json --compare before.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.configs import small_config

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "1 rank": (1, {}),
    "ddp 2": (2, {}),
    "zero1 2": (2, {"parallel.zero_stage": 1}),
    "zero2 2": (2, {"parallel.zero_stage": 2}),
    "zero3 2": (2, {"parallel.zero_stage": 3}),
    "zero3 bf16 2": (2, {"parallel.zero_stage": 3, "parallel.param_dtype": "bf16"}),
    "ddp bf16 autocast 2": (2, {"parallel.param_dtype": "bf16"}),
    "ddp ac full 2": (2, {"parallel.activation_checkpointing": "full"}),
    "ddp topk:0.1 2": (2, {"compression.method": "topk:0.1"}),
    "ddp grad_accum 2": (2, {"grad_accum": 2}),
    "tp2": (2, {"parallel.tp": 2}),
    "tp2 sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "pp2 1f1b": (2, {"parallel.pp": 2}),
    "dp2 x pp2": (4, {"parallel.pp": 2}),
    "dp2 x tp2 zero2": (4, {"parallel.tp": 2, "parallel.zero_stage": 2}),
}


def _run(overrides: dict[str, Any]) -> list[float]:
    from torsh_distributed.train import TrainConfig, train

    cfg = small_config(steps=8)
    data = cfg.to_dict()
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        (data[section] if section else data)[name] = value
    return train(TrainConfig.from_dict(data)).losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", help="a previous --out file to compare with")
    parser.add_argument("--only", nargs="*", help="layouts to run (default: all)")
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {}
    for name, (ranks, overrides) in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        results[name] = run_distributed(_run, ranks, args=(overrides,), timeout=300)[0]
        print(f"{name:>22}: {' '.join(f'{x:.6f}' for x in results[name])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            other = json.load(f)
        print("\nlayout                  max |after - before|")
        for name, losses in results.items():
            if name in other:
                diff = max(abs(a - b) for a, b in zip(losses, other[name], strict=True))
                print(f"{name:>22}: {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
