"""Loss gap of error-feedback compressors vs uncompressed, per optimizer, on 2 CPU ranks.

Error feedback (EF) guarantees that every gradient is sent eventually (exactly: see
``test_error_feedback_is_exact_through_ddp``); its convergence proofs are for SGD. This runs
the built-in trainer (``tiny`` preset, global batch 8, validation loss on 8 fixed batches) for
each optimizer and method over the same steps and seed, and prints the validation-loss gap of
each method to ``none`` under the same optimizer:

* ``adamw``: the trainer's default (lr 3e-3, betas 0.9/0.95);
* ``sgd``: plain SGD (lr 0.5);
* ``sgd-m``: SGD with momentum 0.9 (lr 0.1).

    python benchmarks/bench_compression_optimizers.py --steps 200,1000

Loss is deterministic given the seed; nothing here is a timing.
"""

from __future__ import annotations

import argparse

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

OPTIMIZERS = {
    "adamw": {"optimizer": "adamw", "lr": 3e-3},
    "sgd": {"optimizer": "sgd", "lr": 0.5},
    "sgd-m": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9},
}


def _config(method: str, optim: dict, steps: int, seed: int) -> dict:
    cfg = preset("tiny")
    cfg.max_steps, cfg.batch_size, cfg.seed = steps, 8, seed
    cfg.progress = False
    cfg.eval_batches = 8
    cfg.compression.method = method
    for key, value in optim.items():
        setattr(cfg.optim, key, value)
    return cfg.to_dict()


def _rank(runs: dict[str, dict]) -> dict[str, float]:
    return {name: train(TrainConfig.from_dict(cfg)).val_loss for name, cfg in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="200,1000", help="comma-separated budgets")
    parser.add_argument("--methods", default="topk:0.01,randomk:0.5,sign,ef21:topk:0.1")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    budgets = [int(s) for s in args.steps.split(",")]
    methods = ["none", *args.methods.split(",")]
    optimizers = args.optimizers.split(",")
    runs = {
        f"{opt}|{steps}|{m}": _config(m, OPTIMIZERS[opt], steps, args.seed)
        for opt in optimizers
        for steps in budgets
        for m in methods
    }
    loss = run_distributed(_rank, 2, args=(runs,), timeout=3600)[0]
    print(f"validation-loss gap vs none with the same optimizer, seed {args.seed}, 2 ranks\n")
    print("| optimizer | steps | none | " + " | ".join(methods[1:]) + " |")
    print("|---|---:|---:|" + "---:|" * (len(methods) - 1))
    for opt in optimizers:
        for steps in budgets:
            base = loss[f"{opt}|{steps}|none"]
            gaps = [(loss[f"{opt}|{steps}|{m}"] - base) / base for m in methods[1:]]
            cells = " | ".join(f"{g:+.1%}" for g in gaps)
            print(f"| {opt} | {steps} | {base:.3f} | {cells} |")


if __name__ == "__main__":
    main()
