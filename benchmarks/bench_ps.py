"""Parameter server vs synchronous DDP (the engine) with one genuinely slower worker.

One run, side by side: the same MLP, data, global batch, steps and optimizer (Adam, constant lr,
no clipping) trained by

- the parameter server with 1 server + 3 workers at staleness 0 (synchronous), 2, 8 and -1
  (asynchronous); worker 0 gets 10/12 of every step's batch (10x the compute of the others, not
  a sleep);
- DDP through the engine on 3 ranks (even split: DDP has no per-rank shares; every rank waits for
  the slowest at each all-reduce, so a straggler costs it a whole step each time).

Prints throughput (samples/s over all workers), final loss (on the first global-batch of training samples),
the staleness histogram and push/pull latency p50/p99. Usage::

    python benchmarks/bench_ps.py [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from torsh_distributed.testing import models as M
from torsh_distributed.testing import run_distributed

D_IN, HIDDEN, N = 256, 1024, 4096


def _model() -> nn.Module:
    return M.mlp(d_in=D_IN, hidden=HIDDEN)


def _data() -> M.PairDataset:
    return M.classification_data(n=N, d_in=D_IN)


def _ps(staleness: int, steps: int, batch: int, lr: float) -> dict | None:
    from torsh_distributed.ps import PSConfig, PSTrainConfig, ServerOptimConfig, run

    torch.set_num_threads(1)
    cfg = PSTrainConfig(ps=PSConfig(num_servers=1, staleness=staleness, timeout_s=300),
                        optim=ServerOptimConfig(kind="adam", lr=lr), max_steps=steps, batch_size=batch,
                        shares=(10, 1, 1), threads=(1, 1, 1), eval_samples=batch)
    out = run(_model, _data(), nn.functional.cross_entropy, cfg)
    if out is not None:
        out.pop("params")
        out["final_loss"] = out.pop("eval_loss")  # the final parameters on the first batch, as DDP's val_loss
    return out


def _ddp(steps: int, batch: int, lr: float) -> dict:
    from torsh_distributed.engine import Engine
    from torsh_distributed.engine.config import EngineConfig, OptimConfig

    torch.set_num_threads(1)
    data = _data()
    cfg = EngineConfig(max_steps=steps, batch_size=batch, progress=False, threads=1, eval_batches=1,
                       optim=OptimConfig(lr=lr, warmup_steps=0, schedule="constant", weight_decay=0.0,
                                         grad_clip=0.0, beta2=0.999))
    evalset = M.PairDataset(data.inputs[:batch], data.targets[:batch])
    result = Engine(_model, dataset=data, val_dataset=evalset, config=cfg).fit()
    return {"samples_per_s": result.samples_per_s, "final_loss": result.val_loss, "wall_s": result.wall_time_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    t0 = time.time()
    rows["DDP (engine, 3 ranks)"] = run_distributed(
        _ddp, 3, args=(args.steps, args.batch_size, args.lr), timeout=600)[0]
    for s in (0, 2, 8, -1):
        name = {0: "PS sync (s=0)", -1: "PS async (s=-1)"}.get(s, f"PS SSP s={s}")
        rows[name] = run_distributed(_ps, 4, args=(s, args.steps, args.batch_size, args.lr),
                                     init=False, timeout=600)[1]
    base = rows["DDP (engine, 3 ranks)"]["samples_per_s"]
    print(f"\n{args.steps} steps, global batch {args.batch_size}, MLP {D_IN}-{HIDDEN}-4, Adam lr {args.lr}; "
          f"PS: 1 server + 3 workers, worker 0 has 10/12 of each batch; {time.time() - t0:.0f} s total")
    print(f"{'run':24} {'samples/s':>10} {'vs DDP':>7} {'final loss':>10} {'push p50/p99 ms':>16} "
          f"{'pull p50/p99 ms':>16}  staleness histogram")
    for name, r in rows.items():
        lat = ("", "")
        if "push_ms_p50" in r:
            lat = (f"{r['push_ms_p50']:.1f}/{r['push_ms_p99']:.1f}", f"{r['pull_ms_p50']:.1f}/{r['pull_ms_p99']:.1f}")
        print(f"{name:24} {r['samples_per_s']:10.0f} {r['samples_per_s'] / base:6.2f}x {r['final_loss']:10.4f} "
              f"{lat[0]:>16} {lat[1]:>16}  {r.get('staleness_histogram', '')}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk not in ("worker_losses",)} for k, v in rows.items()},
                      fh, indent=2, default=str)


if __name__ == "__main__":
    main()
