"""Train your own model on the workers of a Ray or a Dask cluster, with checkpoints and resume.

    python examples/ray_dask.py --backend ray  --workers 2 --max-steps 40
    python examples/ray_dask.py --backend dask --workers 2 --max-steps 40
    python examples/ray_dask.py --backend ray  --address auto            # a running Ray cluster
    python examples/ray_dask.py --backend dask --address tcp://host:8786 # a running scheduler

``launch.ray`` / ``launch.dask`` call one function as every rank of a job, each rank in its own
worker process, with torchrun's variables set and the process group already started; the
function is ordinary code written for ``torsh-dist run``. Here it is the engine with a user's
model, loss and dataset, DDP over the workers, and a checkpoint every 10 steps. Without
``--address`` a local cluster of ``--workers`` single-threaded processes is started and stopped.

Run the same command again with a larger ``--max-steps``: it resumes from the newest checkpoint.
If a worker dies (try ``kill -9`` on one mid-run) the call raises an error naming the rank within
about ``--timeout`` + 10 s, never hangs; running the command again resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from torch import nn
from torch.utils.data import Subset

from torsh_distributed import launch
from torsh_distributed.engine import Engine, EngineConfig
from torsh_distributed.testing.models import classification_data, mlp


def train_on_rank(max_steps: int, checkpoint_dir: str) -> dict[str, Any]:
    """What every rank runs: build, train, return this rank's view of the result."""
    config = EngineConfig(max_steps=max_steps, batch_size=64, log_every=10)
    config.optim.lr = 1e-2
    config.checkpoint.dir = checkpoint_dir
    config.checkpoint.every = 10
    data = classification_data(n=4608)  # your map-style dataset of (input, target) pairs
    result = Engine(
        lambda: mlp(d_in=16, hidden=64, classes=4),  # your nn.Module (or a factory of one)
        dataset=Subset(data, range(4096)),
        val_dataset=Subset(data, range(4096, len(data))),  # held out
        loss_fn=nn.functional.cross_entropy,  # your loss(output, target)
        config=config,
    ).fit()
    return {
        "world_size": result.world_size,
        "steps": result.steps,
        "initial_loss": result.initial_loss,
        "final_loss": result.final_loss,
        "val_loss": result.val_loss,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("ray", "dask"), required=True)
    parser.add_argument("--workers", type=int, default=2, help="ranks, one worker process each")
    parser.add_argument("--max-steps", type=int, default=40, help="optimizer steps in all")
    parser.add_argument("--checkpoint-dir", default="runs/ray-dask", help="saved to, resumed from")
    parser.add_argument(
        "--address", default=None, help="a running cluster (Ray: 'auto' or host:port; Dask: "
        "tcp://host:8786); default: start a local one"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for the rendezvous and each "
        "collective: a dead or hung rank fails the call within about this + 10 s"
    )
    args = parser.parse_args(argv)
    run = launch.ray if args.backend == "ray" else launch.dask
    results = run(
        train_on_rank,
        num_workers=args.workers,
        args=(args.max_steps, args.checkpoint_dir),
        timeout_s=args.timeout,
        address=args.address,
    )
    assert all(r == results[0] for r in results), "ranks disagree"  # the engine's result is global
    print(json.dumps({"backend": args.backend, **results[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
