"""Peer-replicated checkpoints vs today's async save: step stall and bytes replicated per save.

Three Gloo ranks, each a simulated host (``TORSH_NODE_ASSIGNMENT=0,1,2``) with a checkpoint
directory of its own, train the built-in model (``--preset``, DDP) and checkpoint it. In every
round, in alternating order, the same processes run:

* ``async``: today's ``CheckpointManager(async_save=True)`` on one directory (the shared-FS case);
* ``peer``: ``CheckpointManager(async_save=True, peer_replicas=K)``, one directory per host:
  the same in-memory snapshot, then in the background the local write, the SHA-256 manifest and
  the replication to K other hosts over a Gloo group;
* ``none``: the same steps without a save (the baseline step time).

Per mode: the stall (how long ``save`` blocks the loop: the copy into host buffers), the mean
time of the ``--steps-after`` training steps that follow the save (they run while the background
write and replication compete for the CPU), and the time until the save is committed. Bytes
replicated per save: what each rank sent, summed, beside the size of one complete checkpoint.

Usage::

    python benchmarks/bench_checkpoint_peer.py                      # tiny preset, K = 1
    python benchmarks/bench_checkpoint_peer.py --preset small --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torsh_distributed.checkpoint import CheckpointManager
from torsh_distributed.models.gpt import GPT
from torsh_distributed.parallel.data import apply_ddp
from torsh_distributed.testing import run_distributed
from torsh_distributed.train import preset

HOSTS = 3


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _job(preset_name: str, rounds: int, steps_after: int, replicas: int, directory: str) -> dict:
    config = preset(preset_name)
    torch.manual_seed(0)
    base = GPT(config.model)
    model = apply_ddp(base)
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (4, config.model.block_size))

    def step() -> float:
        started = time.perf_counter()
        _, loss = model(x, x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - started

    rank = dist.get_rank()
    root = Path(directory)
    managers = {
        "async": CheckpointManager(root / "shared", keep_last=2),
        "peer": CheckpointManager(root / f"host{rank}", keep_last=2, peer_replicas=replicas),
    }
    step()  # optimizer state exists, as in training
    stalls: dict[str, list[float]] = {"async": [], "peer": [], "none": []}
    after: dict[str, list[float]] = {"async": [], "peer": [], "none": []}
    commit: dict[str, list[float]] = {"async": [], "peer": []}
    sent: list[int] = []
    modes = ["async", "peer", "none"]
    for r in range(rounds + 1):  # round 0 warms up (thread pools, buffers, groups)
        for mode in modes if r % 2 else modes[::-1]:
            dist.barrier()
            started = time.perf_counter()
            stall = (
                managers[mode].save(r + 1, model=model, optimizer=optimizer)
                if mode != "none"
                else 0.0
            )
            times = [step() for _ in range(steps_after)]
            if mode != "none":
                managers[mode].wait()
            done = time.perf_counter() - started
            if r == 0:
                continue
            stalls[mode].append(stall)
            after[mode].extend(times)
            if mode != "none":
                commit[mode].append(done)
            if mode == "peer":
                peer = managers["peer"].peer
                assert peer is not None
                sent.append(peer.stats.last_bytes_sent)
    for manager in managers.values():
        manager.close()
    out = {
        "stall": {m: statistics.median(v) for m, v in stalls.items()},
        "after": {m: statistics.mean(v) for m, v in after.items()},
        "commit": {m: statistics.median(v) for m, v in commit.items()},
        "sent": statistics.median(sent),
        "params": base.num_params(),
    }
    if rank == 0:
        out["full_bytes"] = _dir_bytes(root / "shared" / f"step_{rounds + 1:08d}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="built-in model preset (tiny, small)")
    parser.add_argument("--rounds", type=int, default=5, help="timed saves per mode")
    parser.add_argument("--steps-after", type=int, default=3, help="steps timed after each save")
    parser.add_argument("--replicas", type=int, default=1, help="peer replicas K (< 3)")
    args = parser.parse_args()
    env = {"TORSH_NODE_ASSIGNMENT": ",".join(str(h) for h in range(HOSTS)), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(
            _job,
            HOSTS,
            args=(args.preset, args.rounds, args.steps_after, args.replicas, tmp),
            env=env,
            timeout=1800,
        )
    first = results[0]
    sent = sum(r["sent"] for r in results)
    full = first["full_bytes"]
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(
        f"preset {args.preset}: {first['params'] / 1e6:.2f}M params, {HOSTS} Gloo ranks = "
        f"{HOSTS} simulated hosts, K = {args.replicas}, {os.cpu_count()} CPU cores, "
        f"load {' '.join(load)}; rank 0, medians of {args.rounds} rounds\n"
    )
    print("| mode | save stall | mean step after the save | save -> committed |")
    print("|---|---|---|---|")
    for mode in ("none", "async", "peer"):
        commit = f"{first['commit'][mode] * 1e3:.0f} ms" if mode in first["commit"] else "-"
        print(
            f"| {mode} | {first['stall'][mode] * 1e3:.1f} ms | "
            f"{first['after'][mode] * 1e3:.1f} ms | {commit} |"
        )
    print(
        f"\nstall peer / async: {first['stall']['peer'] / first['stall']['async']:.2f}; "
        f"step after the save, peer / async: {first['after']['peer'] / first['after']['async']:.2f}"
    )
    print(
        f"bytes replicated per save (all ranks): {sent / 2**20:.2f} MiB = "
        f"{sent / full:.2f} x one complete checkpoint ({full / 2**20:.2f} MiB)"
    )


if __name__ == "__main__":
    main()
