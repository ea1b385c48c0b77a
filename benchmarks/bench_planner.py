"""Strategy planner: predicted vs measured memory and step time of 4 layouts on 2 CPU ranks.

The built-in GPT (4 layers, width 384, 4 heads, context 128, fp32 AdamW, global batch 16) is
trained on 2 Gloo ranks (1 thread each) in four layouts, in alternating rounds (order rotated
every round): ``dp2 z0`` (DDP), ``dp2 z3`` (FSDP2), ``tp2`` and ``pp2`` (1F1B, 4 micro-batches).
The planner (:func:`torsh_distributed.plan.strategy.evaluate_layout`, ``layout="fsdp2"``) predicts
the same four layouts on a "device" calibrated *before* the runs, from measurements that are
not the quantities predicted:

* link: timed 2-rank all-reduces of 4 kB and 16 MB (median of 7 each) give alpha and beta of
  the ring model (``2 alpha + bytes * beta``); :func:`~torsh_distributed.comm.cost_model.probe_link`'s
  ping-pong is printed beside them (under load its two sizes drown in scheduling noise);
* compute: both ranks at once time forward + backward of one transformer block at the dp
  layouts' per-rank batch; achieved FLOP/s = the planner's FLOP count of that block / time;
* process overhead: peak RSS of the same layout with a negligible model (2 blocks of width 8),
  the runtime's equivalent of a GPU's CUDA context; it is added to the planner's memory.

Measured: peak RSS (max over ranks; glibc's mmap threshold fixed at 64 KiB so RSS tracks live
tensors, see docs/sharding.md) and step time = global batch / samples per second (median over
rounds). Prints one markdown table.

    python benchmarks/bench_planner.py --rounds 3 --steps 6
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import sys
import time
from typing import Any

from torsh_distributed.testing import run_distributed

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2 z0": {"zero_stage": 0},
    "dp2 z3": {"zero_stage": 3},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "microbatches": 4},
}
_PLANNER = {  # the same layouts for the planner: degrees, stage, micro-batch (global batch 16)
    "dp2 z0": {"dp": 2, "stage": 0, "micro_batch": 8},
    "dp2 z3": {"dp": 2, "stage": 3, "micro_batch": 8},
    "tp2": {"dp": 1, "tp": 2, "micro_batch": 16},
    "pp2": {"dp": 1, "pp": 2, "micro_batch": 4},
}
SHAPE = {"n_layer": 4, "d_model": 384, "n_head": 4, "block_size": 128}
NULL = {"n_layer": 2, "d_model": 8, "n_head": 2, "block_size": 128}
BATCH = 16
_M_MMAP_THRESHOLD = -3


def _mallopt() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(_M_MMAP_THRESHOLD, 65536)


def _config(name: str, steps: int, shape: dict[str, int]) -> Any:
    from torsh_distributed.train import TrainConfig, preset

    cfg = preset("tiny").to_dict()
    cfg["model"].update(shape)
    cfg.update(max_steps=steps, batch_size=BATCH, progress=False, eval_batches=1, threads=1)
    cfg["data"]["max_bytes"] = 300_000
    cfg["optim"]["warmup_steps"] = 1
    cfg["parallel"].update(LAYOUTS[name])
    return TrainConfig.from_dict(cfg)


def _calibrate() -> dict[str, float]:
    """Link alpha/beta by ping-pong, and the achieved FLOP/s of one block on both ranks at once."""
    import torch
    import torch.distributed as dist

    from torsh_distributed.comm.cost_model import probe_link
    from torsh_distributed.models.config import ModelConfig
    from torsh_distributed.models.gpt import Block

    torch.set_num_threads(1)
    # a 2-rank ring all-reduce of B bytes takes 2 alpha + B beta: time two sizes (median of 7)
    sizes, secs = (4 << 10, 16 << 20), []
    for size in sizes:
        buf = torch.zeros(size // 4)
        runs = []
        for _ in range(8):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            runs.append(time.perf_counter() - start)
        secs.append(statistics.median(runs[1:]))
    beta = max((secs[1] - secs[0]) / (sizes[1] - sizes[0]), 1e-12)
    alpha = max((secs[0] - sizes[0] * beta) / 2, 1e-7)
    probe = probe_link(0, 1, small=1024, large=4 << 20, repeats=5)  # reported, for comparison
    assert probe is not None
    cfg = ModelConfig(vocab_size=256, **SHAPE)
    block = Block(cfg)
    tokens = BATCH // 2 * cfg.block_size
    x = torch.randn(BATCH // 2, cfg.block_size, cfg.d_model, requires_grad=True)
    times = []
    for i in range(8):
        dist.barrier()
        start = time.perf_counter()
        block(x).sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in block.parameters())
    flops = tokens * (6 * params + 12 * cfg.block_size * cfg.d_model)
    rate = torch.tensor([flops / statistics.median(times)])
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)  # the slower rank sets the pace
    return {
        "alpha": alpha,
        "beta": beta,
        "flops": float(rate),
        "probe_alpha": probe.alpha,
        "probe_beta": probe.beta,
    }


def _round(steps: int, order: list[str], null: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from torsh_distributed.train import train

    _mallopt()
    out: dict[str, Any] = {"calibration": _calibrate(), "runs": {}, "null": {}}
    for name in order:
        if null:  # the runtime's own peak in this layout (a negligible model), run first so
            # that the measured run finds the same modules imported
            base = train(_config(name, 2, NULL))
            peak = torch.tensor([float(base.memory["peak_rss_bytes"])])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out["null"][name] = float(peak)
        result = train(_config(name, steps, SHAPE))
        peak = torch.tensor([float(result.memory["peak_rss_bytes"])])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out["runs"][name] = {
            "step_s": BATCH / result.samples_per_s,
            "peak": float(peak),
            "num_params": result.num_params,
        }
    return out


def _predict(cal: dict[str, float], num_params: int) -> dict[str, Any]:
    from torsh_distributed.plan.strategy import StrategyConfig, evaluate_layout

    cfg = StrategyConfig(
        params=num_params,
        layers=SHAPE["n_layer"],
        hidden=SHAPE["d_model"],
        heads=SHAPE["n_head"],
        seq_len=SHAPE["block_size"],
        vocab=256,
        devices=2,
        nodes=1,
        device_memory=24e9,
        intra_bw=1 / cal["beta"],
        inter_bw=1 / cal["beta"],
        intra_latency=cal["alpha"],
        inter_latency=cal["alpha"],
        global_batch=BATCH,
        dtype="fp32",
        optimizer="adam",
        device="cpu",
        device_flops=cal["flops"],
        activation_checkpointing="none",
        layout="fsdp2",
        reserve=0,
    )
    return {name: evaluate_layout(cfg, **kw) for name, kw in _PLANNER.items()}


def _ranks(values: dict[str, float]) -> dict[str, int]:
    return {name: i for i, name in enumerate(sorted(values, key=values.__getitem__), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    names = list(LAYOUTS)
    rounds = []
    started = time.perf_counter()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        rounds.append(run_distributed(_round, 2, args=(args.steps, order, r == 0), timeout=1500)[0])
    keys = ("alpha", "beta", "flops", "probe_alpha", "probe_beta")
    cal = {k: statistics.median(x["calibration"][k] for x in rounds) for k in keys}
    null = rounds[0]["null"]
    measured = {
        n: {k: statistics.median(x["runs"][n][k] for x in rounds) for k in ("step_s", "peak")}
        for n in names
    }
    preds = _predict(cal, rounds[0]["runs"]["dp2 z0"]["num_params"])
    pred_time = {n: preds[n].step_time for n in names}
    meas_time = {n: measured[n]["step_s"] for n in names}
    pr, mr = _ranks(pred_time), _ranks(meas_time)
    print(
        f"2 ranks x 1 thread, GPT {SHAPE}, {rounds[0]['runs']['dp2 z0']['num_params']:,} params, "
        f"global batch {BATCH}, fp32 AdamW; {args.steps} steps x {args.rounds} rounds (medians); "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(
        f"calibration: link alpha {cal['alpha'] * 1e6:.0f} us, {1 / cal['beta'] / 1e9:.2f} GB/s "
        f"(ping-pong probe: {cal['probe_alpha'] * 1e6:.0f} us, "
        f"{1 / cal['probe_beta'] / 1e9:.2f} GB/s); "
        f"compute {cal['flops'] / 1e9:.1f} GFLOP/s per rank (one block, forward + backward)"
    )
    print(
        "| layout | predicted memory (runtime + planner) | measured peak RSS | error | planner "
        "only | measured - runtime | error | predicted step (compute / comm / bubble) | "
        "measured step | predicted rank | measured rank |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
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
            f"{t['total'] * 1e3:.0f} ms ({t['compute'] * 1e3:.0f} / {comm * 1e3:.0f} / "
            f"{t['bubble'] * 1e3:.0f}) | {meas_time[n] * 1e3:.0f} ms | {pr[n]} | {mr[n]} |"
        )
    same = [pr[n] for n in names] == [mr[n] for n in names]
    print(f"ranking by step time matches: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
