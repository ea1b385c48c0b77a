"""FSDP2's own CPU runtime on one rank: the same GPT step plain and with ``fully_shard`` per block
and the root, side by side in one process (issue 40: the simulator's missing ZeRO-3 term).

On a 1-rank Gloo group FSDP2's collectives move nothing, so what the sharded step costs more is
its runtime: the hooks, the copy-in/copy-out of the (trivial) gathers and reduce-scatters, and the
optimizer step on DTensor shards (timed apart: AdamW's ``step()`` on the same gradients). The
model is the one ``benchmarks/bench_sim_netlab.py`` runs in the lab (4 layers, width 384, 4 heads,
context 128), ``--batch`` sequences per step, one torch thread. Order: plain, sharded, plain again
(the plain figure is the mean of the two).

Usage::

    .venv/bin/python benchmarks/bench_fsdp_cpu_overhead.py [--batch 8] [--reps 4]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sim_netlab import _train_config  # noqa: E402


def _time(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reps: int) -> tuple[float, float]:
    """(seconds per training step, seconds per optimizer step alone)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def backward() -> None:
        out = model(x)
        nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()

    def step() -> None:
        backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    per_step = (time.perf_counter() - start) / reps
    backward()
    start = time.perf_counter()
    for _ in range(reps):
        opt.step()
    per_opt = (time.perf_counter() - start) / reps
    opt.zero_grad()
    return per_step, per_opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--reps", type=int, default=4, help="timed steps per variant")
    args = parser.parse_args()
    from torsh_distributed.models.gpt import GPT

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29643")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = _train_config("ddp", 1, args.batch).model
    torch.manual_seed(0)
    base = GPT(cfg)
    block = cfg.block_size
    x = torch.randint(0, cfg.vocab_size, (args.batch, block))
    y = torch.randint(0, cfg.vocab_size, (args.batch, block))
    plain1 = _time(copy.deepcopy(base), x, y, args.reps)
    sharded_model = copy.deepcopy(base)
    units = list(sharded_model.blocks)
    for unit in units:
        fully_shard(unit)
    fully_shard(sharded_model)
    sharded = _time(sharded_model, x, y, args.reps)
    plain2 = _time(copy.deepcopy(base), x, y, args.reps)
    plain = ((plain1[0] + plain2[0]) / 2, (plain1[1] + plain2[1]) / 2)
    print(f"load {os.getloadavg()[0]:.2f}; {sum(p.numel() for p in base.parameters()):,} params, "
          f"{len(units) + 1} FSDP2 units, batch {args.batch} x {block}")
    print(f"step: plain {plain[0] * 1e3:.0f} ms, fully_shard {sharded[0] * 1e3:.0f} ms, "
          f"FSDP2 runtime {(sharded[0] - plain[0]) * 1e3:+.0f} ms")
    print(f"optimizer step alone: plain {plain[1] * 1e3:.0f} ms, DTensor shards "
          f"{sharded[1] * 1e3:.0f} ms ({(sharded[1] - plain[1]) * 1e3:+.0f} ms)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
