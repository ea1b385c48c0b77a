"""A client's round: local training of the global model with the engine, on its share of the data.

:func:`train_round` is the whole client, independent of Flower: the global weights in, the
client's weights, sample count and metrics out. With ``client.nproc`` 1 it runs the
:class:`~torsh_distributed.engine.Engine` in this process; with N > 1 it runs an N-rank
data-parallel job (DDP, or ZeRO with ``client.zero_stage``) through ``torsh-dist run`` (its
ranks fork from one process that imported torch) whose rank 0 hands the trained weights back in a file
(loaded with ``weights_only=True``). The engine draws each step's global batch as a pure
function of ``(seed, step)`` and splits it among the ranks, so an N-rank client's update equals a
1-rank client's on the same data (a parity test checks it).

FedProx's proximal term ``mu/2 ||w - w_global||^2`` is added to the client's loss; stragglers
(``federated.stragglers``) do a seeded share of their local steps, as in the FedProx paper.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.task import Task

__all__ = ["LocalResult", "node_partition", "straggler_steps", "train_round"]

StateDict = dict[str, torch.Tensor]


@dataclass(slots=True)
class LocalResult:
    """What a client sends back after a round (besides the weights)."""

    state: StateDict = field(repr=False)
    """The client's model weights after local training (full, unsharded, on CPU)."""
    num_examples: int
    """Samples the client holds: FedAvg's weight n_k."""
    loss: float
    """Mean training loss of the round's local steps."""
    steps: int
    """Local steps done (fewer than configured for a straggler)."""
    straggler: bool
    """This client was a straggler this round."""
    seconds: float
    """Wall time of the local training."""
    describe: str = ""
    """The client's data, in words."""


def node_partition(node_config: Any, clients: int) -> int:
    """The partition id a SuperNode was started with (Flower's node config), checked against the
    run's number of clients.

    Raises:
        ValueError: no ``partition-id``, or a node started for another number of clients.
    """
    if "partition-id" not in node_config:
        raise ValueError(
            "this SuperNode has no partition-id in its node config: start it with "
            "--node-config 'partition-id=I num-partitions=N' (torsh-dist federated-node does)"
        )
    pid, num = int(node_config["partition-id"]), int(node_config.get("num-partitions", clients))
    if num != clients:
        raise ValueError(f"this SuperNode was started for {num} partitions, the run has {clients} clients")
    return pid


def straggler_steps(config: FederatedConfig, *, server_round: int, partition_id: int, steps: int) -> int:
    """Local steps of client ``partition_id`` in ``server_round``: ``steps``, or for a straggler
    (a seeded ``stragglers`` share of the clients each round) a uniform draw in ``1..steps``."""
    if not config.stragglers:
        return steps
    rng = random.Random(config.seed * 1_000_003 + server_round)
    count = round(config.stragglers * config.clients)
    slow = set(rng.sample(range(config.clients), count))
    draws = [rng.randint(1, steps) for _ in range(config.clients)]
    return draws[partition_id] if partition_id in slow else steps


def _proximal(loss_fn: Callable[[Any, Any], torch.Tensor], model: nn.Module, mu: float) -> Callable[[Any, Any], torch.Tensor]:
    """``loss + mu/2 ||w - w0||^2`` with ``w0`` the weights at the start of the round (FedProx).

    The term's gradient ``mu (w - w0)`` is the same on every data-parallel rank, so DDP's
    averaging keeps it exact."""
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params]

    def loss(output: Any, target: Any) -> torch.Tensor:
        prox = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))
        return loss_fn(output, target) + 0.5 * mu * prox

    return loss


def local_train(
    task: Task,
    model: nn.Module,
    dataset: Any,
    *,
    steps: int,
    seed: int,
    proximal_mu: float = 0.0,
) -> tuple[float, int]:
    """Train ``model`` in place for ``steps`` engine steps on ``dataset`` (on every rank of a
    client job, or alone); returns (mean loss, steps)."""
    from torsh_distributed.energy.config import EnergyConfig
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.engine.engine import Engine
    from torsh_distributed.parallel.config import ParallelConfig

    client = task.config.client
    loss_fn = task.loss()
    if proximal_mu:
        loss_fn = _proximal(loss_fn, model, proximal_mu)

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if client.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=client.lr, weight_decay=0.0)
        return torch.optim.SGD(params, lr=client.lr, momentum=client.momentum)

    config = EngineConfig(
        max_steps=steps,
        batch_size=client.batch_size,
        seed=seed,
        progress=False,
        backend="gloo",
        optim=OptimConfig(grad_clip=0.0),
        parallel=ParallelConfig(zero_stage=client.zero_stage),
        energy=EnergyConfig(meter="off"),
        # the threads this process was started with (the deployment's OMP_NUM_THREADS, 1 unless
        # the user set it), not the engine's default of every core per rank: the clients that
        # share a host train at the same time (4 local clients at 2 threads each on 2 cores
        # spun in OpenMP's waits: 5.6-13 CPU-s for the same round)
        threads=torch.get_num_threads(),
    )
    engine = Engine(
        model,
        dataset=dataset,
        config=config,
        loss_fn=loss_fn,
        optimizer=optimizer,
        sampler=task.sampler,
        tokens_per_sample=task.tokens_per_sample,
        name="client",
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the engine's first line and table
        result = engine.fit()
    return sum(result.losses) / len(result.losses), result.steps


def _full_state(model: nn.Module) -> StateDict:
    """Unsharded CPU weights (a collective under ZeRO: every rank calls it)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dist.is_initialized():
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
    else:
        state = model.state_dict()
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def train_round(
    config: FederatedConfig,
    global_state: StateDict,
    *,
    partition_id: int,
    server_round: int,
    proximal_mu: float = 0.0,
) -> LocalResult:
    """Client ``partition_id``'s round ``server_round`` from the global weights ``global_state``.

    Raises:
        ValueError: bad data for this client (e.g. fewer samples than one batch).
        RuntimeError: the client's N-rank job failed (its output is in the message).
    """
    task = Task(config)
    data = task.client_data(partition_id)
    num_examples = len(data.dataset)
    full = task.local_steps(num_examples)
    steps = straggler_steps(config, server_round=server_round, partition_id=partition_id, steps=full)
    seed = config.seed + 7919 * server_round + 104_729 * partition_id
    started = time.perf_counter()
    if config.client.nproc == 1:
        model = task.model()
        model.load_state_dict(global_state)
        loss, done = local_train(task, model, data.dataset, steps=steps, seed=seed, proximal_mu=proximal_mu)
        state = _full_state(model)
    else:
        state, loss, done = _train_multirank(
            config, global_state, partition_id=partition_id, steps=steps, seed=seed, proximal_mu=proximal_mu
        )
    return LocalResult(
        state=state,
        num_examples=num_examples,
        loss=loss,
        steps=done,
        straggler=steps < full,
        seconds=time.perf_counter() - started,
        describe=data.describe,
    )


def _train_multirank(
    config: FederatedConfig,
    global_state: StateDict,
    *,
    partition_id: int,
    steps: int,
    seed: int,
    proximal_mu: float,
) -> tuple[StateDict, float, int]:
    with tempfile.TemporaryDirectory(prefix="torsh-fl-client-") as tmp:
        work = Path(tmp)
        torch.save(global_state, work / "global.pt")
        spec = {
            "config": json.loads(config.to_json()),
            "partition_id": partition_id,
            "steps": steps,
            "seed": seed,
            "proximal_mu": proximal_mu,
        }
        (work / "spec.json").write_text(json.dumps(spec))
        cmd = [  # `torsh-dist run`: its ranks fork from one process that imported torch once
            sys.executable, "-m", "torsh_distributed.cli.main", "run",
            f"--nproc-per-node={config.client.nproc}",
            "-m", "torsh_distributed.federated._client_worker", str(work),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            errors = sorted(work.glob("error-*.txt"))
            text = errors[0].read_text() if errors else proc.stdout + proc.stderr
            tail = "\n".join(text.strip().splitlines()[-12:])
            raise RuntimeError(
                f"client {partition_id}'s {config.client.nproc}-rank job failed "
                f"(exit {proc.returncode}):\n{tail}"
            )
        out = json.loads((work / "result.json").read_text())
        state = torch.load(work / "state.pt", weights_only=True)
        return state, float(out["loss"]), int(out["steps"])
