"""FSDP2's cost on a CPU at world size 2, by number of units: what the simulator's measured
per-unit term (``device_profile._time_fsdp_unit``) leaves out (issue 40, ZeRO-3 on the lab).

Two ranks over loopback (Gloo, 1 thread each). The lab's GPT (width 384, 4 heads, context 128,
8 sequences per rank) with 0, 1, 2 and 4 blocks, each trained for a few steps plain (every rank
its own replica, no communication) and as the engine's ZeRO-3 applies FSDP2 (a unit per block,
then the root: embedding, final norm, head), clipping and AdamW as the engine steps. Per block
count: the median step of each, rounds alternating the order. ``ZeRO-3 - plain`` at 0 blocks is
the root unit's cost; its growth per block is a block's cost in a chain, to compare with
``device_profile``'s one block timed alone (printed beside it, the same spec as the lab's) plus
the raw all-gathers and reduce-scatter of a block's bytes.

    .venv/bin/python benchmarks/bench_fsdp_units.py [--blocks 0,1,2,4] [--steps 5] [--rounds 3]
    sudo .venv/bin/python benchmarks/bench_fsdp_units.py --lab 0    # two namespace hosts, veth

``--lab MBIT`` runs the same two ranks on two network-lab hosts (the simulator's lab link).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def _work(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torsh_distributed.models.gpt import GPT, lm_loss
    from torsh_distributed.parallel.sharded import apply_fsdp
    from torsh_distributed.plan.device_profile import time_kernels
    from torsh_distributed.train.config import ModelConfig

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    d, ctx, batch = 384, 128, args["batch"]

    def build(blocks: int, sharded: bool) -> tuple[Any, Any]:
        torch.manual_seed(0)
        gpt = GPT(ModelConfig(block_size=ctx, n_layer=max(blocks, 1), n_head=4, d_model=d))
        if blocks == 0:
            gpt.blocks = torch.nn.ModuleList()
        if sharded:
            apply_fsdp(gpt, mesh, stage=3, units=list(gpt.blocks))
        return gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-6, foreach=True)

    idx = torch.randint(0, 256, (batch, ctx), generator=torch.Generator().manual_seed(1))

    def step(model: Any, optim: Any) -> None:
        optim.zero_grad(set_to_none=True)
        lm_loss(model(idx), idx).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optim.step()

    out: dict[str, Any] = {"rounds": []}
    models = {(n, s): build(n, s) for n in args["blocks"] for s in (False, True)}
    for pair in models.values():
        step(*pair)  # warm-up (FSDP2's lazy initialisation)
    for r in range(args["rounds"]):
        keys = list(models) if r % 2 == 0 else list(reversed(list(models)))
        row: dict[str, float] = {}
        for key in keys:
            times = []
            for _ in range(args["steps"]):
                dist.barrier()
                start = time.perf_counter()
                step(*models[key])
                times.append(time.perf_counter() - start)
            t = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
            row[f"{key[0]}{'z3' if key[1] else 'plain'}"] = float(t)
        out["rounds"].append(row)
    spec = {
        "gemms": [], "act": 4, "repeats": 5, "tokens": batch * ctx, "hidden": d, "ffn": 4 * d,
        "attention": (batch, 4, ctx, d // 4), "optimizer_tensors": [d * d] * 4 + [d] * 8,
        "fsdp": True,
    }  # fmt: skip
    unit = time_kernels(spec, dist.barrier)
    out["unit"] = {k: v for k, v in unit.items() if k.startswith("fsdp")}
    return out


def _in_lab(rate: float, argv: list[str]) -> dict[str, Any]:
    """Run this script's ``_work`` on two network-lab hosts, one rank each."""
    import subprocess
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from netlab import NetLab

    with tempfile.TemporaryDirectory(prefix="torsh-fsdp-units-") as tmp:
        out = Path(tmp) / "result.json"
        with NetLab(hosts=2, rate_mbit=rate, net=151) as lab:
            procs = [
                lab.popen(
                    rank,
                    [sys.executable, __file__, *argv, "--worker", str(out)],
                    env=lab.rank_env(rank=rank, world_size=2, ranks_per_host=1, master_port=29681),
                    stdout=subprocess.DEVNULL,
                )
                for rank in range(2)
            ]
            codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise RuntimeError(f"lab ranks failed with exit codes {codes}")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", default="0,1,2,4")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument(
        "--lab",
        type=float,
        default=None,
        metavar="MBIT",
        help="run the two ranks on two network-lab hosts (root; 0 = no rate limit) instead of "
        "over loopback",
    )
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = {
        "blocks": [int(b) for b in args.blocks.split(",")],
        "steps": args.steps,
        "rounds": args.rounds,
        "batch": args.batch,
    }
    if args.worker:  # one rank inside a lab host; rank 0 writes the result
        import torch.distributed as dist

        dist.init_process_group("gloo")
        res = _work(cfg)
        if dist.get_rank() == 0:
            with open(args.worker, "w") as fh:
                json.dump(res, fh)
        dist.barrier()  # leave together (as bench_sim_netlab's ranks: no teardown under a peer)
        dist.destroy_process_group()
        return 0
    load = os.getloadavg()[0]
    if args.lab is None:
        from torsh_distributed.testing import run_distributed

        res = run_distributed(_work, 2, args=(cfg,), timeout=1800)[0]
        where = "loopback"
    else:
        res = _in_lab(args.lab, sys.argv[1:])
        where = f"2 lab hosts, {args.lab:g} Mbit/s" if args.lab else "2 lab hosts, veth unlimited"
    print(f"2 ranks, {where}, load {load:.1f} -> {os.getloadavg()[0]:.1f}; s/step per round\n")
    print("| blocks | plain (rounds) | ZeRO-3 (rounds) | ZeRO-3 - plain (median) |")
    print("|---:|---|---|---:|")
    extra = {}
    for n in cfg["blocks"]:
        p = [r[f"{n}plain"] for r in res["rounds"]]
        z = [r[f"{n}z3"] for r in res["rounds"]]
        extra[n] = statistics.median(b - a for a, b in zip(p, z, strict=True))
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"| {n} | {fmt(p)} | {fmt(z)} | {extra[n]:.3f} |")
    u = res["unit"]
    alone = u["fsdp_forward_s"] + u["fsdp_backward_s"] + u["fsdp_optimizer_s"]
    raw = 2 * u["fsdp_raw_gather_s"] + u["fsdp_raw_scatter_s"]
    print(
        f"\nroot unit (0 blocks): {extra[min(cfg['blocks'])]:.3f} s a step"
        + (
            f"; per block in a chain: {(extra[max(cfg['blocks'])] - extra[min(cfg['blocks'])]) / (max(cfg['blocks']) - min(cfg['blocks'])):.3f} s"
            if len(cfg["blocks"]) > 1
            else ""
        )
        + f"\none block alone (device_profile): FSDP2's own {alone:.3f} s + raw collectives "
        f"{raw:.3f} s = {alone + raw:.3f} s a step"
    )
    print("\n" + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
