"""The trainer's loop for tensor and pipeline parallelism (issue 7), dp x tp x pp.

Order of application (per rank): build the whole model from the seed (identical everywhere)
-> **pipeline split** (keep this rank's stages) -> **tensor parallelism** of each stage (or of the
whole model) -> data parallelism over the ``dp`` axis as one averaged gradient all-reduce after
backward (ZeRO/FSDP over ``dp`` is not combined yet). Gradient clipping sums squares over the
``tp`` shards and the ``pp`` stages. The step differs from the data-parallel loop in that a
pipeline runs the forward and backward of all micro-batches in ``schedule.step``.

Checkpoints work as in the data-parallel loop (``--checkpoint-dir``, ``--resume``): the state
dict is taken under the whole model's names (:meth:`PipelineRunner.state_module`), so the pipeline
ranks write disjoint parts of one model, and DCP can load it at another pipeline or data-parallel
degree; a different tensor-parallel degree is refused (the fused ``qkv`` rows are stored in the
TP order). Monitoring (``--monitor`` and its report, metrics, dashboard, alerts) works as in the
data-parallel loop; a pipeline step's forward and backward interleave, so both count as
``backward``, and the gradient all-reduces over ``tp``/``dp`` as ``comm_wait``. Gradient
compression (``--compression``) applies to the ``dp`` exchange of the local gradient shards, with
the DDP loop's accounting, warm-up, error state (saved in checkpoints) and summary; it needs
dp > 1 and ZeRO stage 0. Features of the data-parallel loop that this loop does not drive
(comm algorithms and hooks, memory report) are warned about when they are set.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.comm.dims import ParallelDims
from torsh_distributed.parallel.pipeline import build_pipeline, check_pipeline
from torsh_distributed.parallel.sharded import apply_fsdp
from torsh_distributed.parallel.tensor import (
    apply_tp,
    average_replicated_grads,
    check_tp,
    clip_grad_norm_,
    reduce_partial_grads,
    sync_grads,
)
from torsh_distributed.runtime import world

if TYPE_CHECKING:
    from torsh_distributed.train.config import TrainConfig
    from torsh_distributed.data.corpus import Corpus
    from torsh_distributed.train.loop import TrainResult

__all__ = ["check_model_parallel", "train_model_parallel"]


def check_model_parallel(config: TrainConfig, world_size: int) -> ParallelDims:
    """Validate degrees, shapes and micro-batching for ``world_size`` ranks; no collectives.

    Every rank evaluates this on the same config, so an invalid set-up raises the same
    ``ValueError`` everywhere before any rank waits on another.

    Returns:
        Unbuilt :class:`ParallelDims` with the resolved degrees.
    """
    par, model = config.parallel, config.model
    try:
        dims = ParallelDims(dp=par.dp, tp=par.tp, pp=par.pp, world_size=world_size)
    except ValueError as exc:
        raise ValueError(f"parallel degrees do not match the world size: {exc}") from None
    check_tp(
        tp=dims.tp,
        n_head=model.n_head,
        d_model=model.d_model,
        vocab_size=model.vocab_size,
        sequence_parallel=par.sequence_parallel,
        block_size=model.block_size,
    )
    per_dp = config.check_world(dims.dp)
    if par.zero_stage and dims.dp < 2:
        raise ValueError(
            f"parallel.zero_stage {par.zero_stage} shards over the dp axis, but dp = {dims.dp}; "
            f"use zero_stage 0 or a world of dp * tp * pp with dp >= 2"
        )
    if dims.pp > 1:
        check_pipeline(
            pp=dims.pp,
            schedule=par.pp_schedule,
            microbatches=par.num_microbatches,
            virtual_stages=par.virtual_stages,
            n_layer=model.n_layer,
            batch_size=per_dp,
        )
    elif par.virtual_stages != 1:
        raise ValueError(f"parallel.virtual_stages={par.virtual_stages} needs parallel.pp > 1")
    return dims


def _warn_ignored(config: TrainConfig) -> None:
    from torsh_distributed.train.config import TrainConfig as Fresh

    default = Fresh()
    for section in ("comm",):
        if getattr(config, section) != getattr(default, section):
            warnings.warn(
                f"the {section} section is ignored with parallel.tp/pp > 1 (model-parallel loop)",
                stacklevel=3,
            )


def train_model_parallel(
    config: TrainConfig, runtime: world.Runtime, corpus: Corpus, started: float
) -> TrainResult:
    """Train with ``dp x tp x pp`` parallelism; the same :class:`TrainResult` as the DDP loop."""
    from torsh_distributed.data.corpus import sample_batch
    from torsh_distributed.train.loop import TrainResult, _optimizer, lr_at
    from torsh_distributed.models.gpt import GPT
    from torsh_distributed.engine.progress import Progress, format_summary

    dims = check_model_parallel(config, runtime.world_size)
    _warn_ignored(config)
    par, device = config.parallel, runtime.device
    dims.device_type = device.type
    dims.build()
    dp_rank = dims.mesh["dp"].get_local_rank()
    pp_rank = dims.mesh["pp"].get_local_rank()
    dp_group, pp_group = dims.group("dp"), dims.group("pp")
    tp_mesh, dp_mesh = dims.mesh["tp"], dims.mesh["dp"]
    fsdp = par.zero_stage >= 2

    def shard(module: nn.Module, *, loss_parallel: bool = False) -> nn.Module:
        # order: TP first (FSDP2 then shards the TP DTensors over dp: a 2-D dp x tp layout)
        apply_tp(
            module, tp_mesh, loss_parallel=loss_parallel, sequence_parallel=par.sequence_parallel
        )
        if fsdp:
            apply_fsdp(
                module,
                dp_mesh,
                stage=par.zero_stage,
                units=list(module.blocks),
                param_dtype=par.param_dtype,
                reduce_dtype=par.reduce_dtype,
                offload=par.offload,
            )
        return module

    torch.manual_seed(config.seed)  # identical initial weights on every rank
    model = GPT(config.model).to(device)
    total_params = model.num_params()
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    use_loss_parallel = dims.pp == 1 and dims.tp > 1
    pipe = None
    if dims.pp > 1:
        pipe = build_pipeline(
            model,
            pp_rank=pp_rank,
            pp=dims.pp,
            group=pp_group,
            device=device,
            schedule=par.pp_schedule,
            microbatches=par.num_microbatches,
            virtual_stages=par.virtual_stages,
            transform=shard,
        )
        params: list[nn.Parameter] = pipe.parameters()
        holder: nn.Module = nn.ModuleList(pipe.modules)
    else:
        shard(model, loss_parallel=use_loss_parallel)
        params, holder = list(model.parameters()), model
    del model
    from torsh_distributed.compression.trainer import TrainerCompression

    whole = pipe.state_module() if pipe is not None else holder  # the whole model's names
    compression = TrainerCompression(config)  # validates (ZeRO stage 0 only)
    compression.attach_flat(
        dp_group if dims.dp > 1 and not fsdp else None,
        positions={id(p): order.get(name, -1) for name, p in whole.named_parameters()},
    )
    optimizer = _optimizer(holder, config.optim)
    if dims.tp > 1 and not fsdp:  # foreach kernels reject lists mixing DTensor and plain tensors
        for group in optimizer.param_groups:
            group["foreach"] = False

    from torsh_distributed.checkpoint.trainer import TrainerCheckpoint

    ckpt = TrainerCheckpoint(
        config,
        model=whole,
        optimizer=optimizer,
        num_train_tokens=corpus.train.numel(),
        layout={"tp": dims.tp} if dims.tp > 1 else None,  # qkv rows in TP order
        rank_state={"compression": compression.stateful},  # residuals, PowerSGD factors
    )
    start_step, losses = ckpt.resume()

    def loss_context() -> contextlib.AbstractContextManager:
        if not use_loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def global_mean(loss: torch.Tensor | None) -> float:
        # every tp rank of the last stage holds the same loss; the dp ranks hold different ones
        value = torch.zeros((), device=device) if loss is None else loss.detach().clone()
        if runtime.world_size > 1:
            dist.all_reduce(value)
        return float(value) / (dims.dp * dims.tp)

    def run(x: torch.Tensor, y: torch.Tensor, *, train: bool) -> float:
        x, y = x.to(device), y.to(device)
        if pipe is not None:
            return global_mean(pipe.step(x, y) if train else pipe.evaluate(x, y))
        with loss_context():
            _, loss = holder(x, y)
            if train:
                loss.backward()
        return global_mean(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    per_dp = config.batch_size // dims.dp
    tokens_per_step = config.batch_size * config.model.block_size
    if runtime.is_main:
        print(
            f"torsh-dist train: {total_params / 1e6:.2f}M params, world size {runtime.world_size} "
            f"= dp {dims.dp} x tp {dims.tp} x pp {dims.pp}"
            + (f" ({par.pp_schedule}, {par.num_microbatches} micro-batches)" if dims.pp > 1 else "")
            + f", global batch {config.batch_size} ({per_dp}/dp rank) x {config.model.block_size} tokens",
            flush=True,
        )
    progress = Progress(
        total=config.max_steps, enabled=runtime.is_main and config.progress, desc="train"
    )
    loop_time = 0.0
    batch = dict(
        batch_size=config.batch_size,
        block_size=config.model.block_size,
        rank=dp_rank,
        num_ranks=dims.dp,
    )
    from torsh_distributed.monitor.trainer import TrainerMonitor

    # one rank per data-parallel replica counts its samples (the job's rate is the ranks' sum)
    counts = dims.mesh["tp"].get_local_rank() == 0 and pp_rank == dims.pp - 1
    monitor = TrainerMonitor(
        config.monitor,
        rank=runtime.rank,
        world_size=runtime.world_size,
        local_world_size=world.local_world_size(),
        device=device,
        max_steps=config.max_steps,
        samples_per_step=per_dp if counts else 0,
        tokens_per_step=per_dp * config.model.block_size if counts else 0,
        params=params,
        echo=progress.write if config.progress else None,
    )
    for step in range(start_step, config.max_steps):
        t0 = time.perf_counter()
        monitor.step_begin(step)
        lr = lr_at(step, optim=config.optim, max_steps=config.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = sample_batch(corpus.train, seed=config.seed, step=step, **batch)
        monitor.phase("data")
        optimizer.zero_grad(set_to_none=True)
        global_loss = run(x, y, train=True)
        monitor.phase("backward")  # forward + backward (interleaved in a pipeline)
        if dims.tp > 1:  # sequence-parallel norms' Partial gradients: one all-reduce over tp
            reduce_partial_grads(params)
        if not fsdp:  # FSDP2 reduce-scatters (averages) the gradients over dp itself
            reduce = compression.reduce_flat if compression.hook is not None else None
            sync_grads(params, dp_group, dims.dp, reduce=reduce)
            if reduce is not None and dims.tp > 1:  # compression saw different shards per tp rank
                average_replicated_grads(params, dims.group("tp"), dims.tp)
        monitor.phase("comm_wait")
        grad_norm = None
        if config.optim.grad_clip:
            grad_norm = clip_grad_norm_(params, config.optim.grad_clip, pp_group=pp_group)
        optimizer.step()
        monitor.phase("optimizer")
        if not math.isfinite(global_loss):
            raise FloatingPointError(
                f"loss became {global_loss} at step {step + 1}; lower --lr (now {config.optim.lr})"
            )
        losses.append(global_loss)
        compression.observe_loss(global_loss)
        monitor.step_end(step + 1, loss=global_loss, lr=lr, grad_norm=grad_norm)
        loop_time += time.perf_counter() - t0
        ckpt.step_end(step + 1, losses)  # save if due
        if (step + 1) % config.log_every == 0 or step == 0 or step + 1 == config.max_steps:
            progress.update_to(
                step + 1,
                loss=global_loss,
                tok_s=tokens_per_step * (step + 1 - start_step) / loop_time,
            )
    progress.close()
    monitor_report = monitor.finish()  # last aggregation (collective), bottleneck report
    ckpt.finish(config.max_steps, losses)  # final save, wait for async saves

    from torsh_distributed.train.loop import _EVAL_STEP_BASE

    total = 0.0
    for i in range(config.eval_batches):
        x, y = sample_batch(corpus.val, seed=config.seed, step=_EVAL_STEP_BASE + i, **batch)
        with torch.no_grad():
            holder.eval()
            total += run(x, y, train=False)
            holder.train()
    tail = losses[-min(10, len(losses)) :]
    result = TrainResult(
        steps=len(losses),
        losses=losses,
        initial_loss=losses[0],
        final_loss=sum(tail) / len(tail),
        val_loss=total / config.eval_batches,
        tokens_per_s=tokens_per_step * (len(losses) - start_step) / loop_time if loop_time else 0.0,
        world_size=runtime.world_size,
        wall_time_s=time.perf_counter() - started,
        num_params=total_params,
        backend=runtime.backend,
        checkpoint=ckpt.summary(),
        monitor=monitor_report,
        compression=compression.summary() if compression.hook is not None else {},
    )
    if runtime.is_main:
        print(format_summary(result.summary()), flush=True)
        if config.summary_json:
            path = Path(config.summary_json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result.summary(), indent=2) + "\n")
    return result
