"""Your own training loop with the library's pieces: data, DDP, compression, checkpoints, metrics.

    torsh-dist run --nproc-per-node 2 examples/own_loop.py --checkpoint-dir runs/own --max-steps 40

No engine: the loop below is yours, and each piece does one job in it.

* ``DistributedBatchSampler`` feeds a plain ``DataLoader``: the global batch of step ``s`` depends
  only on ``s``, so the data position is one number, valid at any world size.
* ``apply_ddp`` + ``register_compression(model, "powersgd:2")`` compress the gradient all-reduce;
  ``prime_buckets`` lets DDP re-bucket before step 1, so the per-bucket PowerSGD state never resets.
* ``CheckpointManager`` saves model and optimizer every 10 steps and at the end, with the sampler
  position in ``extra`` and the PowerSGD state per rank. Run the same command again (or with a
  larger ``--max-steps``): it resumes from the newest valid checkpoint.
* ``StepMonitor`` times the phases, aggregates across ranks, logs accuracy as a custom metric and
  prints a bottleneck report; ``--metrics-port 9400`` serves Prometheus on 127.0.0.1:9400.

On one process (``python examples/own_loop.py``) the same script runs without DDP or compression.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import torsh_distributed as td
from torsh_distributed.checkpoint import CheckpointManager
from torsh_distributed.compression import prime_buckets, register_compression
from torsh_distributed.data import DistributedBatchSampler
from torsh_distributed.monitor import MonitorConfig, StepMonitor
from torsh_distributed.parallel import apply_ddp
from torsh_distributed.testing.models import classification_data, mlp

GLOBAL_BATCH = 64
SAVE_EVERY = 10
LR = 1e-2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40, help="stop after this many steps in all")
    parser.add_argument("--checkpoint-dir", default="runs/own-loop", help="saved to and resumed from")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 = off")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with td.init() as rt:
        torch.manual_seed(0)  # every rank builds the same model (DDP also broadcasts rank 0's)
        dataset = classification_data(n=4096)
        model = apply_ddp(mlp(d_in=16, hidden=64, classes=4))  # the plain model on one process
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        hook = register_compression(model, "powersgd:2")  # None on one process
        x0, y0 = dataset[0]
        prime_buckets(model, lambda: F.cross_entropy(model(x0[None]), y0[None]))

        sampler = DistributedBatchSampler(
            dataset_len=len(dataset), global_batch=GLOBAL_BATCH, seed=0, num_steps=args.max_steps
        )
        loader = DataLoader(dataset, batch_sampler=sampler)
        manager = CheckpointManager(args.checkpoint_dir, every_steps=SAVE_EVERY, keep_last=2)
        loaded = manager.load(model=model, optimizer=optimizer)
        if loaded is not None:
            sampler.load_state_dict(loaded.meta["extra"]["data"])
            if hook is not None and loaded.rank_tensors is not None:  # None: world size changed
                hook.load_state_dict(loaded.rank_tensors["compression"])
            if rt.is_main:
                print(f"resumed from {loaded.path} at step {loaded.step}", flush=True)
        start = sampler.step

        monitor = StepMonitor(
            MonitorConfig(enabled=True, every=5, metrics_port=args.metrics_port),
            max_steps=args.max_steps,
            samples_per_step=GLOBAL_BATCH // rt.world_size,
            params=list(model.parameters()),
            custom_metrics=("accuracy",),
        )
        loss = torch.tensor(0.0)
        for step, (x, y) in enumerate(loader, start=start):
            monitor.step_begin(step)
            monitor.phase("data")
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            monitor.phase("forward")
            optimizer.zero_grad()
            loss.backward()
            monitor.phase("backward")
            optimizer.step()
            monitor.phase("optimizer")
            if hook is not None:
                hook.observe_loss(loss.item())  # only "auto" adapts to it
            monitor.log("accuracy", (logits.argmax(dim=1) == y).float().mean())
            monitor.step_end(step + 1, loss=loss.detach(), lr=LR)
            done = step + 1
            if manager.due(done) or done == args.max_steps:
                manager.save(
                    done,
                    model=model,
                    optimizer=optimizer,
                    extra={"data": sampler.state_dict()},
                    rank_tensors={"compression": hook.state_dict()} if hook is not None else None,
                )
        manager.close()  # waits for the last background save to commit
        report = monitor.finish()  # collective; rank 0 prints the bottleneck report
        if rt.is_main and sampler.step == start:
            print(f"already at step {start} of --max-steps {args.max_steps}: nothing to train")
        elif rt.is_main:
            accuracy = report.get("custom", {}).get("accuracy", {}).get("last", float("nan"))
            ratio = hook.summary().get("ratio", 1.0) if hook is not None else 1.0
            print(
                f"steps {start} -> {sampler.step}: final loss {loss.item():.4f}, "
                f"accuracy {accuracy:.3f}, compression {ratio:.1f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
