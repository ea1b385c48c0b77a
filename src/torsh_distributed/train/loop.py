"""The training loop of ``torsh-dist train``.

One call, :func:`train`, runs on every rank: it joins (or starts) the process group, builds the
model from the seed (identical on every rank), parallelizes it (DDP or ZeRO-1/2/3; tensor and
pipeline parallelism hand over to their own loop), and steps through the deterministic batches of
:mod:`torsh_distributed.data.corpus`. Rank 0 shows progress and writes the summary. The result is
returned on every rank so tests can compare runs.

Each feature is a component with a few hooks, cheap or a no-op when switched off, so the loop
reads top to bottom: ``TrainerCompression`` (gradient compression hook), ``TrainerMemory``
(predicted vs measured memory), ``LossScaler`` (fp16), ``TrainerComm`` (facade all-reduce hook,
``--trace``), ``TrainerCheckpoint`` (resume, periodic and final saves), ``TrainerMonitor``
(per-phase timings, metrics, report, Prometheus, dashboard).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from torsh_distributed.checkpoint.trainer import TrainerCheckpoint
from torsh_distributed.comm.trainer import TrainerComm
from torsh_distributed.compression.trainer import TrainerCompression
from torsh_distributed.monitor.trainer import TrainerMonitor
from torsh_distributed.parallel._trainer_memory import TrainerMemory, for_table
from torsh_distributed.parallel.data import no_grad_sync
from torsh_distributed.parallel.parallelize import build_parallel_model
from torsh_distributed.parallel.precision import LossScaler  # fp16 loss scaling
from torsh_distributed.parallel.sharded import shard_optimizer
from torsh_distributed.runtime import world
from torsh_distributed.train.config import OptimConfig, TrainConfig
from torsh_distributed.data.corpus import Corpus, load_corpus, sample_batch
from torsh_distributed.models.gpt import GPT
from torsh_distributed.engine.progress import Progress, format_summary

__all__ = ["TrainResult", "train", "lr_at"]

_EVAL_STEP_BASE = 1 << 40  # evaluation batches use step ids far from training steps


@dataclass(kw_only=True, slots=True)
class TrainResult:
    """What a run did; identical on every rank (losses are averaged across ranks)."""

    steps: int
    """Optimizer steps taken."""
    losses: list[float] = field(repr=False)
    """Training loss of every step (global batch mean)."""
    initial_loss: float
    """Loss of the first step."""
    final_loss: float
    """Mean loss of the last ``min(10, steps)`` steps (less noisy than the last step alone)."""
    val_loss: float
    """Validation loss at the end."""
    tokens_per_s: float
    """Training tokens per second, all ranks together, over the training loop's wall time."""
    world_size: int
    """Number of ranks."""
    wall_time_s: float
    """Seconds from start of setup to the end of the final evaluation."""
    num_params: int
    """Parameters of the model."""
    backend: str
    """Process-group backend used."""
    memory: dict = field(default_factory=dict)
    """This rank's memory: measured and predicted model states, peak RSS."""
    compression: dict = field(default_factory=dict)
    """Rank 0's compression totals: method, bytes uncompressed/sent, ratio, seconds."""
    monitor: dict = field(default_factory=dict)
    """Bottleneck report of ``--monitor`` (slowest rank, step time, findings); {} when off."""
    checkpoint: dict = field(default_factory=dict)
    """Checkpoint saves, seconds the loop was blocked by them, step resumed from; {} when off."""
    precision: dict = field(default_factory=dict)
    """Mixed precision: dtypes, and with fp16 the final loss scale and the skipped steps."""

    def summary(self) -> dict[str, float | int | str]:
        """The summary fields (everything except the per-step losses)."""
        data = asdict(self)
        data.pop("losses")
        return data


def lr_at(step: int, *, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate for 0-based ``step``: linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    span = max(max_steps - optim.warmup_steps, 1)
    progress = min((step - optim.warmup_steps) / span, 1.0)
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, foreach=True)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(0.9, 0.95), foreach=True)


def _accumulate(
    model: torch.nn.Module, scaler: LossScaler, x: torch.Tensor, y: torch.Tensor, parts: int
) -> torch.Tensor:
    """Forward/backward ``parts`` equal micro-batches, exchanging gradients only after the last;
    returns the mean loss (the loss of the whole batch)."""
    total = torch.zeros((), device=x.device)
    for i, (xs, ys) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
        if i < parts - 1:
            with no_grad_sync(model):
                _, loss = model(xs, ys)
                scaler.backward(loss / parts)
        else:
            _, loss = model(xs, ys)
            scaler.backward(loss / parts)
        total += loss.detach()
    return total / parts


def _mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over ranks (Gloo has no AVG: sum then divide)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, config: TrainConfig, device: torch.device) -> float:
    """Mean validation loss over ``eval_batches`` fixed batches, split across ranks."""
    model.eval()
    rank, size = world.rank(), world.world_size()
    total = torch.zeros((), device=device)
    for i in range(config.eval_batches):
        x, y = sample_batch(
            corpus.val,
            seed=config.seed,
            step=_EVAL_STEP_BASE + i,
            batch_size=config.batch_size,
            block_size=config.model.block_size,
            rank=rank,
            num_ranks=size,
        )
        _, loss = model(x.to(device), y.to(device))
        total += loss
    model.train()
    return float(_mean_across_ranks(total / config.eval_batches))


def _set_threads(config: TrainConfig) -> None:
    threads = config.threads or max(1, (os.cpu_count() or 1) // world.local_world_size())
    torch.set_num_threads(threads)


def train(config: TrainConfig) -> TrainResult:
    """Train the built-in model as described by ``config`` on this rank; see module docstring.

    Uses the process group if one is running; otherwise starts one from the environment (a world
    of one when not launched) and shuts it down at the end.

    Raises:
        ValueError: the global batch does not divide across the ranks, or the corpus is too small.
    """
    started = time.perf_counter()
    owned = not world.is_initialized()
    runtime = world.init(backend=config.backend)
    try:
        return _train(config, runtime, started)
    finally:
        if owned:
            world.shutdown()


def _train(config: TrainConfig, runtime: world.Runtime, started: float) -> TrainResult:
    rank, size, device = runtime.rank, runtime.world_size, runtime.device
    # Model parallelism: validate dp x tp x pp on every rank before any collective; tp/pp > 1
    # run their own loop (the step is a pipeline schedule).
    if config.parallel.model_parallel or config.parallel.dp != -1:
        from torsh_distributed.parallel._trainer_mp import (
            check_model_parallel,
            train_model_parallel,
        )

        check_model_parallel(config, size)
        if config.parallel.model_parallel and config.grad_accum > 1:
            raise ValueError(
                f"--grad-accum {config.grad_accum} applies to data parallelism; with --tp/--pp "
                "use --microbatches (pipeline micro-batches) instead"
            )
        if config.parallel.model_parallel:
            _set_threads(config)
            corpus = load_corpus(config.data, min_tokens=config.model.block_size + 2)
            return train_model_parallel(config, runtime, corpus, started)
    per_rank = config.check_world(size)
    _set_threads(config)
    corpus = load_corpus(config.data, min_tokens=config.model.block_size + 2)

    torch.manual_seed(config.seed)  # identical initial weights on every rank
    compression = TrainerCompression(config)  # validates; DDP options for the wrap below
    # Sharding: DDP or ZeRO-1/2/3, offload, mixed precision, activation checkpointing.
    memory = TrainerMemory(config, world_size=size)  # RSS now = the process baseline
    base, model = build_parallel_model(
        lambda: GPT(config.model), config.parallel, device=device, seed=config.seed
    )
    optimizer = shard_optimizer(_optimizer(base, config.optim), stage=config.parallel.zero_stage)
    scaler = LossScaler(config.parallel, device=device)  # fp16: dynamic loss scaling, else no-op
    compression.attach(model, base)  # gradient compression hook (compression.stateful)
    # facade comm hook (unless compression's hook carries the algorithm), --trace, debug mode
    comm = TrainerComm(config.comm, model, compressed=compression.hook is not None)
    tokens_per_step = config.batch_size * config.model.block_size

    if runtime.is_main:
        print(
            f"torsh-dist train: {base.num_params() / 1e6:.2f}M params, world size {size} "
            f"({runtime.backend}), global batch {config.batch_size} ({per_rank}/rank) x "
            f"{config.model.block_size} tokens, corpus {corpus.train.numel() / 1e6:.2f}M train / "
            f"{corpus.val.numel() / 1e6:.2f}M val bytes from {corpus.num_files} files",
            flush=True,
        )
    progress = Progress(
        total=config.max_steps, enabled=runtime.is_main and config.progress, desc="train"
    )
    ckpt = TrainerCheckpoint(
        config,
        model=model,
        optimizer=optimizer,
        num_train_tokens=corpus.train.numel(),
        json_state={"loss_scaler": scaler},
        rank_state={"compression": compression.stateful},  # residuals, PowerSGD factors
    )
    start_step, losses = ckpt.resume()
    monitor = TrainerMonitor(  # per-rank metrics, report, Prometheus, dashboard, alerts
        config.monitor, rank=rank, world_size=size, local_world_size=world.local_world_size(),
        device=device, max_steps=config.max_steps, samples_per_step=per_rank,
        tokens_per_step=per_rank * config.model.block_size, params=list(base.parameters()),
        echo=progress.write if config.progress else None,
    )
    val_loss = float("nan")
    loop_time = 0.0
    for step in range(start_step, config.max_steps):
        t0 = time.perf_counter()
        monitor.step_begin(step)
        lr = lr_at(step, optim=config.optim, max_steps=config.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = sample_batch(
            corpus.train,
            seed=config.seed,
            step=step,
            batch_size=config.batch_size,
            block_size=config.model.block_size,
            rank=rank,
            num_ranks=size,
        )
        monitor.phase("data")
        if config.grad_accum == 1:
            _, loss = model(x.to(device), y.to(device))
            monitor.phase("forward")
            optimizer.zero_grad(set_to_none=True)
            scaler.backward(loss)  # loss.backward(), scaled for fp16
        else:  # forward and backward interleave: both count as "backward" in the monitor
            optimizer.zero_grad(set_to_none=True)
            loss = _accumulate(model, scaler, x.to(device), y.to(device), config.grad_accum)
        monitor.phase("backward")
        grad_norm = None  # reported by --monitor when clipping computes it
        scaler.unscale(optimizer)  # fp16: true gradients before clipping
        if config.optim.grad_clip:
            grad_norm = torch.nn.utils.clip_grad_norm_(base.parameters(), config.optim.grad_clip)
        scaler.step(optimizer)  # fp16: skipped on every rank if a gradient overflowed
        monitor.phase("optimizer")
        memory.after_step(  # predicted vs measured after the first step
            base, optimizer, main=runtime.is_main, write=progress.write if config.progress else print
        )
        global_loss = float(_mean_across_ranks(loss.detach()))
        if not math.isfinite(global_loss):
            raise FloatingPointError(
                f"loss became {global_loss} at step {step + 1}; lower --lr (now {config.optim.lr})"
            )
        losses.append(global_loss)
        monitor.step_end(step + 1, loss=global_loss, lr=lr, grad_norm=grad_norm)
        loop_time += time.perf_counter() - t0
        ckpt.step_end(step + 1, losses)  # save if due
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.max_steps:
            val_loss = evaluate(model, corpus, config, device)
            progress.write(f"step {step + 1}: val loss {val_loss:.4f}")
        if (step + 1) % config.log_every == 0 or step == 0 or step + 1 == config.max_steps:
            progress.update_to(
                step + 1,
                loss=global_loss,
                tok_s=tokens_per_step * (step + 1 - start_step) / loop_time,
                **monitor.postfix(),  # samples/s and the slowest rank
            )
    progress.close()
    monitor_report = monitor.finish()  # last aggregation (collective), bottleneck report
    ckpt.finish(config.max_steps, losses)  # final save, wait for async saves
    comm.finish(main=runtime.is_main)  # merged Chrome trace on rank 0
    val_loss = evaluate(model, corpus, config, device)
    tail = losses[-min(10, len(losses)) :]
    result = TrainResult(
        steps=len(losses),
        losses=losses,
        initial_loss=losses[0],
        final_loss=sum(tail) / len(tail),
        val_loss=val_loss,
        tokens_per_s=tokens_per_step * (len(losses) - start_step) / loop_time if loop_time else 0.0,
        world_size=size,
        wall_time_s=time.perf_counter() - started,
        num_params=base.num_params(),
        backend=runtime.backend,
        memory=memory.summary(),
        compression=compression.summary(),
        monitor=monitor_report,
        checkpoint=ckpt.summary(),
        precision=scaler.summary(),
    )
    if runtime.is_main:
        # The monitor's report and the checkpoint line were printed above, and compression
        # "none" says nothing: the JSON summary keeps all of them.
        hidden = {"monitor", "checkpoint"}
        if result.compression.get("method", "none") == "none":
            hidden.add("compression")
        table = {k: v for k, v in result.summary().items() if k not in hidden}
        print(format_summary(for_table(table)), flush=True)
        if config.summary_json:
            path = Path(config.summary_json)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(result.summary(), indent=2) + "\n")
            tmp.replace(path)  # never leave a half-written summary behind
    return result
