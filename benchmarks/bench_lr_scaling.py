"""Does ``--lr-ref-batch`` pay? The built-in GPT at global batches other than the one its learning
rate was tuned at: the lr the engine's rule gives against the best lr of a sweep at that batch.

1. **Tune** at the reference batch: ``--lrs`` swept, the lowest validation loss picks the tuned
   lr (the premise of any scaling rule: an lr that was *tuned* at the reference).
2. At each other batch (``--ratios`` times the reference, ``1/ratio`` the steps: the same
   samples), run the tuned lr unchanged (``none``), scaled by the engine's ``auto`` rule (square
   root for AdamW, linear for SGD up to 32x) and by the other rule, and sweep ``--lrs`` scaled by
   the ratio's range for the best lr there (the oracle).
3. Report each rule's lr against the oracle's and its validation loss gap to the oracle.

Every run is the engine in this process (one rank: a global batch's arithmetic is the same at
any world size, tests/distributed prove it), one after another; ``--seeds`` repeats it all::

    python benchmarks/bench_lr_scaling.py                        # AdamW and SGD, tiny preset
    python benchmarks/bench_lr_scaling.py --optimizers adamw --ratios 4 --seeds 1234,1
    python benchmarks/bench_lr_scaling.py --smoke                # seconds: 8 steps
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

LRS = {"adamw": "1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2", "sgd": "0.125,0.25,0.5,1,2,4"}
"""Default sweeps (factors of 2 around the tiny preset's AdamW 3e-3 and SGD's 0.5)."""


def _run(optimizer: str, *, lr: float, batch: int, steps: int, rule: str, ref_batch: int,
         warmup: int, seed: int, eval_batches: int) -> dict:
    from torsh_distributed.train import OptimConfig, preset, train

    cfg = preset("tiny")
    scaled = rule != "none" and batch != ref_batch
    cfg = dataclasses.replace(
        cfg,
        max_steps=steps,
        batch_size=batch,
        seed=seed,
        progress=False,
        eval_batches=eval_batches,
        optim=OptimConfig(
            optimizer=optimizer,
            lr=lr,
            warmup_steps=warmup,
            weight_decay=0.0 if optimizer == "sgd" else 0.01,
            lr_ref_batch=ref_batch if scaled else 0,
            lr_scaling=rule if scaled else "auto",
        ),
    )
    started = time.perf_counter()
    result = train(cfg)
    return {
        "optimizer": optimizer, "batch": batch, "steps": steps, "rule": rule, "seed": seed,
        "lr": result.lr_scaling.get("lr", lr),
        "chosen": result.lr_scaling.get("rule", "none"),
        "warmup_steps": result.lr_scaling.get("warmup_steps", warmup),
        "val_loss": result.val_loss, "final_loss": result.final_loss,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--ratios", default="0.25,4", help="global batch / the reference batch")
    parser.add_argument("--ref-batch", type=int, default=32, help="the tiny preset's batch")
    parser.add_argument("--ref-steps", type=int, default=200, help="steps at the reference batch")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up steps at the reference")
    parser.add_argument("--lrs", default="", help="the sweep, e.g. 1e-3,3e-3 (default per optimizer)")
    parser.add_argument("--seeds", default="1234")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="8 reference steps, a 2-lr sweep")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    for optimizer in args.optimizers.split(","):
        if optimizer not in LRS:
            parser.error(f"--optimizers: {optimizer!r} is not one of {', '.join(LRS)}")
    if args.smoke:
        args.ref_steps, args.eval_batches, args.warmup = 8, 1, 2
    import torch

    torch.set_num_threads(1)
    rows: list[dict] = []

    def run(warmup: int = args.warmup, **kw: object) -> dict:
        row = _run(ref_batch=args.ref_batch, warmup=warmup, eval_batches=args.eval_batches,
                   **kw)  # type: ignore[arg-type]
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    table = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for optimizer in args.optimizers.split(","):
            lrs = [float(x) for x in (args.lrs or LRS[optimizer]).split(",")]
            if args.smoke:
                lrs = lrs[1:3]
            sweep = [run(optimizer=optimizer, lr=lr, batch=args.ref_batch, steps=args.ref_steps,
                         rule="none", seed=seed) for lr in lrs]
            tuned = min(sweep, key=lambda r: r["val_loss"])
            table.append({**tuned, "rule": "tuned (reference)", "oracle_lr": tuned["lr"],
                          "gap": 0.0})
            for ratio in (float(r) for r in args.ratios.split(",")):
                batch, steps = round(args.ref_batch * ratio), max(1, round(args.ref_steps / ratio))
                # the oracle: the same sweep shifted by the ratio's square root (the sweep spans
                # both rules' picks for ratios up to 4 either way), the warm-up's samples kept
                # as the rules keep them: only the lr differs
                shift, warm = ratio ** 0.5, math.ceil(args.warmup / ratio)
                oracle = min((run(optimizer=optimizer, lr=lr * shift, batch=batch, steps=steps,
                                  rule="none", seed=seed, warmup=warm) for lr in lrs),
                             key=lambda r: r["val_loss"])
                other = "sqrt" if optimizer == "sgd" else "linear"
                for rule in ("none", "auto", other):
                    row = run(optimizer=optimizer, lr=tuned["lr"], batch=batch, steps=steps,
                              rule=rule, seed=seed)
                    table.append({**row, "oracle_lr": oracle["lr"],
                                  "gap": row["val_loss"] - oracle["val_loss"]})
                table.append({**oracle, "rule": "best of sweep", "oracle_lr": oracle["lr"],
                              "gap": 0.0})
    print("\n| seed | optimizer | batch | steps | rule | lr | best lr of the sweep | warm-up | "
          "val loss | gap to the best |")
    print("|---:|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in table:
        rule = f"auto ({r['chosen']})" if r["rule"] == "auto" else r["rule"]
        print(f"| {r['seed']} | {r['optimizer']} | {r['batch']} | {r['steps']} | {rule} | "
              f"{r['lr']:.4g} | {r['oracle_lr']:.4g} | {r['warmup_steps']} | {r['val_loss']:.4f} | "
              f"{r['gap']:+.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
