"""A user model, loss, optimizer and dataset trained through the Python API as replica groups
(run by tests/distributed/test_ft_replica_groups.py through the replica-group launcher)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

SEED, NUM_SAMPLES, DIM = 7, 512, 16


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def make_dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(NUM_SAMPLES, DIM, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) * 0.5).tanh() + 0.05 * torch.randn(
        NUM_SAMPLES, 1, generator=g
    )
    return torch.utils.data.TensorDataset(x, y)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def make_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def main() -> None:
    from torsh_distributed.engine import Engine, EngineConfig

    config = EngineConfig.from_dict(json.loads(sys.argv[1]))
    result = Engine(
        make_model,
        dataset=make_dataset(),
        loss_fn=loss_fn,
        optimizer=make_optimizer,
        config=config,
        name="ft-mlp",
        # tensor parallelism inside each group: the two hidden Linears column- then row-wise
        tp_plan={"0": "colwise", "2": "rowwise"} if config.parallel.tp > 1 else None,
    ).fit()
    if len(sys.argv) > 2:  # every step's loss, as this rank saw it (the summary keeps two)
        name = f"losses.g{os.environ['TORSH_FT_GROUP']}.r{os.environ['RANK']}.json"
        (Path(sys.argv[2]) / name).write_text(json.dumps(result.losses))
        if config.compression.enabled:  # this rank's compressor totals (steps, bytes)
            (Path(sys.argv[2]) / name.replace("losses", "compression")).write_text(
                json.dumps(result.compression)
            )


if __name__ == "__main__":
    main()
