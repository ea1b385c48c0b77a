"""Training any model through the parameter server: S server ranks, W worker ranks.

:func:`run` is called on every rank of a launched world (``RANK``/``WORLD_SIZE``; ranks below
``ps.num_servers`` serve, the others train). It takes the same three pieces as the engine: a
model factory, a map-style dataset of ``(input, target)`` pairs and a loss. Each worker, every
step: pulls the dense parameters, computes the gradient of its share of the step's global batch
(sparse ``nn.Embedding(sparse=True)`` tables pull only the rows the batch touches, through a
forward pre-hook, and push only those rows), and pushes it. Worker 0 registers the initial
values, and at the end evaluates the servers' final parameters and builds the summary.

The step's global batch is a pure function of (seed, step): ``batch_size`` consecutive samples of
a seeded permutation, split across workers by ``shares`` (even by default), so a synchronous run
sees exactly the samples of a data-parallel run of the same batch size. ``sampler`` picks the
engine's own samplers instead (``epoch`` or ``replacement``, :mod:`torsh_distributed.data.sampler`):
with them, the servers' optimizer and schedule given as the engine's, and the same seed, a
synchronous run trains as the engine's data-parallel run of the same command.

The summary's ``final_loss`` is the engine's: the mean training loss of the last 10 steps (each
step's loss over the global batch: the workers' losses weighted by their shares); ``eval_loss``
evaluates the final parameters on the dataset's first ``eval_samples`` samples.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torsh_distributed.data.sampler import EpochSampler, GlobalSampler, ReplacementSampler
from torsh_distributed.ps import _shard, _transport
from torsh_distributed.ps.client import PSClient, Rows, percentile
from torsh_distributed.ps.config import PSConfig, ServerOptimConfig, check_clip_mean
from torsh_distributed.ps.server import serve_forever

__all__ = ["PSTrainConfig", "run", "batch_indices"]

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(kw_only=True, slots=True)
class PSTrainConfig:
    """A parameter-server training run."""

    ps: PSConfig
    """Servers, consistency, snapshots, security."""
    optim: ServerOptimConfig = field(default_factory=ServerOptimConfig)
    """The servers' optimizer (and push clipping)."""
    max_steps: int = 50
    """Steps per worker (pushes)."""
    batch_size: int = 32
    """Global batch per step, split over the workers by ``shares``."""
    seed: int = 1234
    """Seed of the model's initial values and of the sample order."""
    shares: tuple[int, ...] = ()
    """Relative share of each step's batch per worker (a larger share = a slower worker); empty =
    even. Each worker's push weight is its fraction of the batch."""
    threads: tuple[int, ...] = ()
    """torch threads per worker (e.g. (1, 2) makes worker 0 slower); empty = leave as is."""
    dtype: str = "fp32"
    """Parameter dtype on workers and servers: ``fp32`` or ``fp64``."""
    eval_samples: int = 256
    """Samples (the dataset's first) on which worker 0 evaluates the final parameters."""
    log_every: int = 0
    """Print worker 0's loss every this many steps; 0 = quiet."""
    summary_json: str = ""
    """Write worker 0's summary here as JSON; empty = don't."""
    sampler: str = ""
    """Each step's global batch: ``""`` = :func:`batch_indices`; ``epoch`` or ``replacement`` =
    the engine's sampler of that kind (``torsh-dist train`` uses the engine's, so a synchronous
    run sees the samples of the data-parallel run of the same command)."""

    def __post_init__(self) -> None:
        if self.sampler not in ("", "epoch", "replacement"):
            raise ValueError(f"sampler must be '', 'epoch' or 'replacement', got {self.sampler!r}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if any(s < 1 for s in self.shares):
            raise ValueError(f"shares must be positive integers, got {self.shares}")
        if any(t < 0 for t in self.threads):
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1, got {self.eval_samples}")
        self.shares = tuple(self.shares)
        self.threads = tuple(self.threads)

    def split(self, num_workers: int) -> list[int]:
        """Samples per worker per step."""
        shares = self.shares or (1,) * num_workers
        if len(shares) != num_workers:
            raise ValueError(f"shares has {len(shares)} entries for {num_workers} workers")
        total = sum(shares)
        if self.batch_size % total:
            raise ValueError(f"batch_size {self.batch_size} must divide by sum(shares) = {total}")
        return [self.batch_size // total * s for s in shares]


def batch_indices(step: int, *, batch_size: int, num_samples: int, seed: int) -> torch.Tensor:
    """Sample indices of global step ``step`` (epochs of seeded permutations, concatenated)."""
    first = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(first + len(out), num_samples)
        perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
        out.extend(perm[offset: offset + batch_size - len(out)].tolist())
    return torch.tensor(out)


def _global_sampler(config: PSTrainConfig, num_samples: int) -> GlobalSampler | None:
    if config.sampler == "replacement":
        return ReplacementSampler(num_samples, global_batch=config.batch_size, seed=config.seed)
    if config.sampler == "epoch":
        return EpochSampler(num_samples, global_batch=config.batch_size, seed=config.seed)
    return None


def _collate(dataset: Any, indices: torch.Tensor, dtype: torch.dtype) -> tuple[Any, Any]:
    items = [dataset[int(i)] for i in indices]
    xs = torch.stack([torch.as_tensor(x) for x, _ in items])
    ys = torch.stack([torch.as_tensor(y) for _, y in items])
    if xs.is_floating_point():
        xs = xs.to(dtype)
    if ys.is_floating_point():
        ys = ys.to(dtype)
    return xs, ys


def _sparse_tables(model: nn.Module) -> dict[str, nn.Embedding]:
    return {f"{name}.weight" if name else "weight": m for name, m in model.named_modules()
            if isinstance(m, nn.Embedding) and m.sparse}


def run(model_fn: Callable[[], nn.Module], dataset: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
        config: PSTrainConfig) -> dict[str, Any] | None:
    """This rank's part of the run; returns the summary on worker 0, ``None`` elsewhere.

    Raises:
        ValueError: a world too small for ``ps.num_servers`` plus one worker, bad shares.
    """
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    num_servers = config.ps.num_servers
    num_workers = world - num_servers
    if num_workers < 1:
        raise ValueError(f"world of {world} has no room for workers beside {num_servers} servers")
    split = config.split(num_workers)
    check_clip_mean(config.optim, config.ps, num_workers=num_workers)
    if rank < num_servers:
        torch.set_num_threads(1)
        serve_forever(rank, rank=rank, world_size=world, num_workers=num_workers,
                      config=config.ps, optim=config.optim)
        return None
    worker = rank - num_servers
    if config.threads:
        torch.set_num_threads(config.threads[worker] or torch.get_num_threads())
    torch.manual_seed(config.seed)
    dtype = DTYPES[config.dtype]
    model = model_fn().to(dtype)
    tables = _sparse_tables(model)
    specs = {k: _shard.TableSpec(num_rows=m.num_embeddings, dim=m.embedding_dim) for k, m in tables.items()}
    dense_keys = [n for n, _ in model.named_parameters() if n not in tables]
    params = dict(model.named_parameters())
    _transport.init(_transport.worker_name(worker), rank=rank, world_size=world, host=config.ps.host,
                    timeout_s=config.ps.timeout_s, num_threads=config.ps.num_threads)
    try:
        # clip_mean with several workers: the server clips the step's mean, not each push
        server_clips = config.optim.clip_mean and config.ps.staleness == 0 and num_workers > 1
        client = PSClient(worker, num_workers=num_workers, config=config.ps, tables=specs,
                          clip_norm=0.0 if server_clips else config.optim.clip_norm)
        if worker == 0:
            client.register({k: params[k] for k in dense_keys}, {k: params[k] for k in tables})
        start_step = client.resume()
        touched: dict[str, torch.Tensor] = {}

        def pull_rows(key: str) -> Callable[..., None]:
            def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
                ids = torch.unique(inputs[0].reshape(-1))
                touched[key] = ids
                with torch.no_grad():
                    module.weight[ids] = client.pull([Rows(key, ids)]).values[0]
            return hook

        for key, module in tables.items():
            module.register_forward_pre_hook(pull_rows(key))
        losses: list[float] = []
        lo = sum(split[:worker])
        sampler = _global_sampler(config, len(dataset))
        t0 = time.perf_counter()
        for step in range(start_step, config.max_steps):
            values = client.pull(dense_keys).values
            with torch.no_grad():
                for key, value in zip(dense_keys, values, strict=True):
                    params[key].copy_(value)
            if sampler is None:
                idx = batch_indices(step, batch_size=config.batch_size, num_samples=len(dataset),
                                    seed=config.seed)
            else:
                idx = sampler.indices(step)
            idx = idx[lo: lo + split[worker]]
            x, y = _collate(dataset, idx, dtype)
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            keys: list[str | Rows] = []
            grads: list[torch.Tensor] = []
            for key in dense_keys:
                keys.append(key)
                grads.append(params[key].grad if params[key].grad is not None else torch.zeros_like(params[key]))
            for key in tables:
                grad = params[key].grad
                if grad is None:
                    continue
                grad = grad.coalesce()
                keys.append(Rows(key, grad.indices()[0]))
                grads.append(grad.values())
            client.push(keys, grads, weight=split[worker] / config.batch_size)
            losses.append(loss.item())
            if config.log_every and worker == 0 and (step + 1) % config.log_every == 0:
                print(f"[ps worker 0] step {step + 1}/{config.max_steps} loss {losses[-1]:.4f}", flush=True)
        elapsed = time.perf_counter() - t0
        client.finish({"losses": losses, "seconds": elapsed, "samples": split[worker] * len(losses),
                       "start_step": start_step})
        if worker != 0:
            return None
        servers = client.stats()
        wall = time.perf_counter() - t0
        final = _final_params(client, model, params, dense_keys, specs)
        return _summary(config, model, final, dataset, loss_fn, servers, wall, dtype)
    finally:
        _transport.shutdown(graceful=True)


def _final_params(client: PSClient, model: nn.Module, params: dict[str, torch.Tensor], dense_keys: list[str],
                  specs: dict[str, _shard.TableSpec]) -> dict[str, torch.Tensor]:
    keys: list[str | Rows] = [*dense_keys, *(Rows(k, torch.arange(s.num_rows)) for k, s in specs.items())]
    values = client.pull(keys, final=True).values
    with torch.no_grad():
        for key, value in zip([*dense_keys, *specs], values, strict=True):
            params[key].copy_(value)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _summary(config: PSTrainConfig, model: nn.Module, final: dict[str, torch.Tensor], dataset: Any,
             loss_fn: Callable[[Any, Any], torch.Tensor], servers: list[dict[str, Any]], wall: float,
             dtype: torch.dtype) -> dict[str, Any]:
    with torch.no_grad():
        n = min(config.eval_samples, len(dataset))
        x, y = _collate(dataset, torch.arange(n), dtype)
        eval_loss = float(loss_fn(model(x), y))
    workers = [servers[0]["workers"][w] for w in sorted(servers[0]["workers"])]
    split = config.split(len(workers))
    steps = min(len(w["losses"]) for w in workers)
    # each step's loss over the global batch: the workers' mean losses weighted by their shares
    losses = [sum(s / config.batch_size * w["losses"][i] for s, w in zip(split, workers, strict=True))
              for i in range(steps)]
    tail = losses[-10:]
    staleness: Counter[int] = Counter()
    for s in servers:
        staleness.update({int(k): v for k, v in s["staleness"].items()})
    push = [t for w in workers for t in w["push_s"]]
    pull = [t for w in workers for t in w["pull_s"]]
    samples = sum(w["samples"] for w in workers)
    out = {
        "mode": config.ps.mode,
        "staleness_bound": config.ps.staleness,
        "num_servers": config.ps.num_servers,
        "num_workers": len(workers),
        "optimizer": config.optim.kind,
        "steps": config.max_steps,
        "wall_s": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "final_loss": sum(tail) / len(tail) if tail else float("nan"),
        "eval_loss": eval_loss,
        "losses": losses,
        "staleness_histogram": dict(sorted(staleness.items())),
        "max_staleness": max(staleness) if staleness else 0,
        "push_ms_p50": 1e3 * percentile(push, 50),
        "push_ms_p99": 1e3 * percentile(push, 99),
        "pull_ms_p50": 1e3 * percentile(pull, 50),
        "pull_ms_p99": 1e3 * percentile(pull, 99),
        "bytes_pushed": sum(w["bytes_pushed"] for w in workers),
        "bytes_pulled": sum(w["bytes_pulled"] for w in workers),
        "rows_pushed": sum(w["rows_pushed"] for w in workers),
        "rows_pulled": sum(w["rows_pulled"] for w in workers),
        "worker_losses": [w["losses"] for w in workers],
        "worker_seconds": [w["seconds"] for w in workers],
        "lost_updates": sum(s["lost_updates"] for s in servers),
        "restored": [s["restored"] for s in servers],
        "snapshots": sum(s["snapshots"] for s in servers),
        "applied": [s["applied"] for s in servers],
        "params": final,
    }
    if config.summary_json:
        text = {k: v for k, v in out.items() if k != "params"}
        with open(config.summary_json, "w") as fh:
            json.dump(text, fh, indent=2)
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines of :func:`run`'s summary."""
    return (
        f"parameter server ({summary['mode']}, s={summary['staleness_bound']}, "
        f"{summary['num_servers']} servers x {summary['num_workers']} workers, {summary['optimizer']}): "
        f"{summary['steps']} steps in {summary['wall_s']:.2f} s, {summary['samples_per_s']:.1f} samples/s, "
        f"final loss {summary['final_loss']:.4f} (last 10 steps), eval loss {summary['eval_loss']:.4f}\n"
        f"  staleness histogram {summary['staleness_histogram']} (max {summary['max_staleness']})\n"
        f"  push p50/p99 {summary['push_ms_p50']:.2f}/{summary['push_ms_p99']:.2f} ms, "
        f"pull p50/p99 {summary['pull_ms_p50']:.2f}/{summary['pull_ms_p99']:.2f} ms, "
        f"{summary['bytes_pushed'] / 1e6:.2f} MB pushed, {summary['bytes_pulled'] / 1e6:.2f} MB pulled\n"
        f"  lost updates {summary['lost_updates']} (restored: {summary['restored']})"
    )
