"""Checkpoint benchmark: training stall of async vs sync saves, and recovery time after SIGKILL.

Both measured in one run, printed as a markdown table:

1. **Stall.** Two Gloo ranks train the built-in model (``--preset``) and checkpoint it
   ``--saves`` times with ``dcp.async_save`` and as many times with ``dcp.save`` (plus, for both,
   the manifest/marker commit). The stall is the time ``CheckpointManager.save`` blocks the
   training loop (rank 0, median); for async that is the copy into host memory, for sync the
   whole write, fsync, hash and commit. Saves are spaced so async ones never wait for each other.
2. **Recovery.** ``torsh-dist train --nproc-per-node 2 --max-restarts 1`` with a fault that
   SIGKILLs rank 1 after step ``--kill-step``; recovery = wall time from the kill to the first
   completed step after the elastic restart (new processes, rendezvous, corpus, model, loading
   the newest checkpoint), from the ``TORSH_FAULT_LOG`` events.

Usage::

    python benchmarks/bench_checkpoint.py                 # tiny preset (default)
    python benchmarks/bench_checkpoint.py --preset small --saves 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torsh_distributed.checkpoint import CheckpointManager
from torsh_distributed.models.gpt import GPT
from torsh_distributed.parallel.data import apply_ddp
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import preset


def _stall_job(preset_name: str, saves: int, directory: str) -> dict:
    config = preset(preset_name)
    torch.manual_seed(0)
    base = GPT(config.model)
    model = apply_ddp(base)
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (4, config.model.block_size))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()  # optimizer state exists, as in training
    results = {}
    for mode in ("async", "sync"):
        manager = CheckpointManager(
            Path(directory) / mode, keep_last=2, async_save=(mode == "async")
        )
        stalls = []
        for i in range(saves + 1):
            stall = manager.save(i + 1, model=model, optimizer=optimizer)
            manager.wait()  # not counted: spaces the saves like a checkpoint interval would
            if i:  # the first save of each mode warms up (thread pools, allocations)
                stalls.append(stall)
        results[mode] = statistics.median(stalls)
    state_bytes = sum(p.numel() * p.element_size() for p in base.parameters()) * 3
    return {**results, "params": base.num_params(), "state_mb": state_bytes / 2**20}


def _recovery(preset_name: str, kill_step: int, every: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "faults.jsonl"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update({"TORSH_FAULT": f"kill:rank=1:step={kill_step}", "TORSH_FAULT_LOG": str(log)})
        argv = [
            sys.executable,
            "-m",
            "torsh_distributed.cli.main",
            "train",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--preset",
            preset_name,
            "--max-steps",
            str(steps),
            "--checkpoint-dir",
            str(Path(tmp) / "ckpt"),
            "--checkpoint-every",
            str(every),
            "--progress",
            "false",
            "--eval-batches",
            "1",
        ]
        started = time.perf_counter()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        total = time.perf_counter() - started
        if proc.returncode:
            raise SystemExit(f"training job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        events = [json.loads(line) for line in log.read_text().splitlines()]
    kill = next(e for e in events if e["event"] == "kill")
    resumed = next(e for e in events if e["event"] == "resumed")
    first = next(e for e in events if e["event"] == "first_step")
    return {
        "recovery_s": first["t"] - kill["t"],
        "resumed_step": resumed["step"],
        "kill_step": kill["step"],
        "job_s": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="built-in model preset (tiny, small)")
    parser.add_argument("--saves", type=int, default=5, help="timed saves per mode")
    parser.add_argument("--kill-step", type=int, default=12, help="step after which rank 1 dies")
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    parser.add_argument("--steps", type=int, default=20, help="training steps of the kill run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stall = run_distributed(_stall_job, 2, args=(args.preset, args.saves, tmp), timeout=600)[0]
    recovery = _recovery(args.preset, args.kill_step, args.every, args.steps)
    ratio = stall["async"] / stall["sync"]
    print(
        f"preset {args.preset}: {stall['params'] / 1e6:.2f}M params, model+AdamW state "
        f"{stall['state_mb']:.1f} MiB, 2 Gloo ranks, {os.cpu_count()} CPU cores\n"
    )
    print("| measure | value | target |")
    print("|---|---|---|")
    print(f"| sync save stall (median of {args.saves}) | {stall['sync'] * 1e3:.1f} ms | |")
    print(f"| async save stall (median of {args.saves}) | {stall['async'] * 1e3:.1f} ms | |")
    print(
        f"| stall ratio async / sync | {ratio:.3f} | <= 0.1 {'met' if ratio <= 0.1 else 'MISSED'} |"
    )
    print(
        f"| recovery: SIGKILL (step {recovery['kill_step']}) -> first step after restart "
        f"(resumed at {recovery['resumed_step']}) | {recovery['recovery_s']:.1f} s | <= 30 s "
        f"{'met' if recovery['recovery_s'] <= 30 else 'MISSED'} |"
    )
    print(f"| whole kill-and-restart job ({args.steps} steps) | {recovery['job_s']:.1f} s | |")


if __name__ == "__main__":
    main()
