"""The engine: one training loop for any model, loss, optimizer and dataset.

:class:`Engine` takes the user's model (or a factory, for meta-device init and pipeline stages),
a loss ``(output, target) -> scalar``, an optimizer factory and a map-style dataset of
``(input, target)`` pairs, and runs every feature of the toolkit on them from one
:class:`~torsh_distributed.engine.config.EngineConfig`: DDP, ZeRO-1/2/3, tensor parallelism by
plan, pipeline parallelism by split points, their 3-D compositions, gradient compression,
gradient accumulation, fp16/bf16, clipping, checkpoints with exact resume (data position, RNG,
loss scale, compressor state; on another world size too), monitoring, memory prediction vs
measurement, evaluation, a progress bar and a summary.

The step is either a data-parallel step (forward, loss, backward; micro-batches under
``no_grad_sync`` with ``grad_accum``) or a pipeline schedule (``schedule.step``); everything else
(learning rate, gradient exchange of model-parallel runs, clipping, the optimizer, checkpoints,
monitoring, evaluation) is the same loop for both.

Data: every step draws a *global* batch of sample indices, a pure function of ``(seed, step)``
(shuffled epochs, or draws with replacement), and data-parallel rank ``r`` of ``n`` takes an equal
contiguous part of it. Runs at different world sizes therefore see the same samples per step and
are comparable to one process; a checkpoint's position is the step, so a run resumes exactly on
another world size.

Example::

    engine = Engine(
        lambda: MyNet(),
        dataset=train_set,
        val_dataset=val_set,
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        config=EngineConfig(max_steps=100, batch_size=64),
    )
    result = engine.fit()  # on every rank, under `torsh-dist run --nproc-per-node 4 script.py`
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from torsh_distributed.data.sampler import (
    EpochSampler,
    GlobalSampler,
    ReplacementSampler,
    fetch,
    shard,
)
from torsh_distributed.engine import _setup as S
from torsh_distributed.engine._checkpoint import RunCheckpoint, computation_settings
from torsh_distributed.engine._comm import CommSetup, node_assignment
from torsh_distributed.engine._compression import GradCompression
from torsh_distributed.engine._memory import MemoryReport, planner_optimizer
from torsh_distributed.engine._moe import MoEHooks
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.engine.optim import build_optimizer, lr_at
from torsh_distributed.engine.progress import Progress
from torsh_distributed.engine.result import TrainResult, report_result
from torsh_distributed.monitor.step import StepMonitor
from torsh_distributed.parallel.data import no_grad_sync
from torsh_distributed.parallel.precision import LossScaler
from torsh_distributed.parallel.rebalance import RebalanceConfig
from torsh_distributed.parallel.sharded import shard_optimizer
from torsh_distributed.parallel.tensor import (
    average_replicated_grads,
    clip_grad_norm_,
    reduce_partial_grads,
    sync_grads,
)
from torsh_distributed.parallel.tp_plan import TPPlan
from torsh_distributed.runtime import world

__all__ = ["Engine", "default_loss", "EVAL_STEP_BASE"]

EVAL_STEP_BASE = 1 << 40
"""Evaluation batches of a with-replacement sampler use step ids far from training steps."""

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of class scores ``(..., C)`` against class indices ``(...)``.

    Raises:
        TypeError: the model's output is not a tensor (pass ``loss_fn`` for other outputs).
    """
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"the default loss (cross-entropy) needs the model to return a tensor of class "
            f"scores, got {type(output).__name__}; pass loss_fn=... (--loss) for other outputs"
        )
    if output.dim() > 2:
        return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
    return F.cross_entropy(output, target)


class Engine:
    """Trains any ``nn.Module`` with the toolkit's parallelism and components; see the module doc.

    Args:
        model: The model, or a function returning it (called under ``config.seed``, so every
            rank builds identical weights; needed for ``parallel.meta_init``).
        dataset: Map-style training dataset of ``(input, target)`` items.
        config: Loop settings and one section per component (defaults: 200 steps, batch 32).
        loss_fn: ``loss_fn(output, target) -> scalar`` (the mean over the batch: gradients then
            equal one process's on the same global batch); cross-entropy by default.
        optimizer: ``factory(parameters) -> Optimizer``; ``None`` = ``config.optim`` (AdamW or
            SGD with warm-up and cosine decay, applied by the engine).
        lr_scheduler: ``factory(optimizer) -> scheduler`` stepped once per step (with a user
            optimizer; ``config.optim``'s schedule applies otherwise).
        val_dataset: Held-out dataset for ``eval_every`` and the final validation loss.
        sampler: ``"epoch"`` (shuffled epochs without replacement, the last partial batch of an
            epoch dropped) or ``"replacement"`` (i.i.d. draws; the built-in corpus's windows).
        collate_fn: Turns a list of items into a batch (torch's ``default_collate`` by default).
        tp_plan: How to shard the model over ``parallel.tp`` ranks (required when tp > 1).
        blocks: Qualified name of the container of repeated blocks (activation checkpointing,
            FSDP units, even pipeline splits); ``None`` = found automatically.
        tokens_per_sample: Tokens in one sample, for the tokens/s figures (0 = not reported).
        activation_bytes: ``f(per_rank_batch) -> bytes`` of activations saved for backward, for
            the peak-memory prediction (``None``: predicted without activations).
        settings: Further settings that change the computation (model shape, data): hashed
            into checkpoints, which are refused by a run with other settings.
        model_info: JSON describing the model for whoever loads its checkpoints (the built-in
            trainer: :func:`~torsh_distributed.models.config.gpt_model_info`); stored in each
            checkpoint's ``meta.json`` (``extra["model"]``), not hashed.
        name: Shown in the progress bar and the first line.
        describe: Extra text for the first line (e.g. the corpus).
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        *,
        dataset: Any,
        config: EngineConfig | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: OptimizerFactory | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        val_dataset: Any = None,
        sampler: str = "epoch",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        tp_plan: TPPlan | Mapping[str, str | ParallelStyle] | None = None,
        blocks: str | None = None,
        tokens_per_sample: int = 0,
        activation_bytes: Callable[[int], int] | None = None,
        settings: Mapping[str, Any] | None = None,
        model_info: Mapping[str, Any] | None = None,
        name: str = "train",
        describe: str = "",
    ) -> None:
        if not (isinstance(model, nn.Module) or callable(model)):
            raise TypeError(f"model must be an nn.Module or a factory, got {type(model).__name__}")
        if sampler not in ("epoch", "replacement"):
            raise ValueError(f"sampler must be 'epoch' or 'replacement', got {sampler!r}")
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"dataset must be a map-style dataset (__getitem__ and __len__), got "
                f"{type(dataset).__name__}"
            )
        if lr_scheduler is not None and optimizer is None:
            raise ValueError("lr_scheduler applies to a user optimizer (optimizer=...)")
        self.config = config or EngineConfig()
        self.model_source = model
        self.dataset, self.val_dataset = dataset, val_dataset
        self.loss_fn = loss_fn or default_loss
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.sampler_kind, self.collate_fn = sampler, collate_fn
        self.tp_plan, self.blocks = tp_plan, blocks
        self.tokens_per_sample = tokens_per_sample
        self.activation_bytes = activation_bytes
        self.settings = dict(settings or {})
        self.model_info = dict(model_info or {})
        self.name, self.describe = name, describe
        optim = self.config.optim
        if optimizer is not None and dataclasses.replace(optim, grad_clip=1.0) != type(optim)():
            warnings.warn(
                "the optim section (lr, schedule, weight decay, optimizer) is ignored: the "
                "optimizer factory and lr_scheduler given to the engine decide (grad_clip applies)",
                stacklevel=2,
            )
        if val_dataset is None and self.config.eval_every:
            warnings.warn(
                f"eval_every={self.config.eval_every} is ignored: no val_dataset to evaluate on",
                stacklevel=2,
            )
        self.train_sampler = self._sampler(len(dataset), "dataset")
        self.val_sampler = (
            self._sampler(len(val_dataset), "val_dataset") if val_dataset is not None else None
        )

    def _sampler(self, size: int, what: str) -> GlobalSampler:
        batch, seed = self.config.batch_size, self.config.seed
        if size < 1:
            raise ValueError(f"{what} is empty")
        if self.sampler_kind == "replacement":
            return ReplacementSampler(size, global_batch=batch, seed=seed)
        if size < batch:
            raise ValueError(
                f"{what} holds {size} samples, fewer than the global batch_size {batch}"
            )
        return EpochSampler(size, global_batch=batch, seed=seed)

    # --- the run ---------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Train on this rank; every rank of the job calls it. Returns the same result on all.

        Uses the running process group, or starts one from the environment (a world of one when
        not launched) and shuts it down at the end.

        Raises:
            ValueError: an invalid setting (the same on every rank, before any collective).
            FloatingPointError: the loss became NaN or infinite.
        """
        started = time.perf_counter()
        owned = not world.is_initialized()
        runtime = world.init(backend=self.config.backend)
        try:
            return self._fit(runtime, started)
        finally:
            if owned:
                world.shutdown()

    def _fit(self, runtime: world.Runtime, started: float) -> TrainResult:
        cfg, par, device = self.config, self.config.parallel, runtime.device
        run = S.plan_run(
            cfg,
            world_size=runtime.world_size,
            tp_plan=self.tp_plan,
            device_type=device.type,
            nodes=node_assignment(cfg.comm),
        )
        dims = run.dims
        with contextlib.ExitStack() as stack:  # hooks, servers, saves released on errors too
            compression = GradCompression(
                cfg.compression, zero_stage=par.zero_stage, algorithm=cfg.comm.algorithm, seed=cfg.seed
            )
            stack.callback(compression.close)
            threads = cfg.threads or max(1, (os.cpu_count() or 1) // world.local_world_size())
            torch.set_num_threads(threads)
            memory = MemoryReport(  # RSS now = the process baseline
                zero_stage=par.zero_stage,
                dp=dims.data_degree,
                optimizer=planner_optimizer(cfg.optim) if self.optimizer_factory is None else "",
                weight_decay=cfg.optim.weight_decay > 0,
                param_dtype=par.param_dtype,
                activations=(lambda: self.activation_bytes(run.per_dp)) if self.activation_bytes else None,
                predict=not run.model_parallel,
            )
            model = S.instantiate(self.model_source, seed=cfg.seed, meta=par.meta_init)
            S.check_model(model, cfg, run)
            dims.build()
            loss_fn = self.loss_fn
            if par.param_dtype != "fp32" and par.zero_stage <= 1:  # the loss under the forward's autocast
                dtype = torch.bfloat16 if par.param_dtype == "bf16" else torch.float16
                loss_fn = torch.autocast(device.type, dtype=dtype)(self.loss_fn)
            built = S.build_model(
                model, cfg, run, device=device, loss_fn=loss_fn, blocks=self.blocks, meta=par.meta_init
            )
            del model
            params = built.params
            optimizer = self._optimizer(built.holder)
            fsdp = par.zero_stage >= 2
            if dims.ep > 1 or (dims.tp > 1 and not fsdp):
                # foreach kernels reject lists mixing DTensor (tp shards, ep experts) and plain
                # tensors, or DTensors of two meshes (FSDP2's dense shards, ep experts)
                for group in optimizer.param_groups:
                    group["foreach"] = False
            dp_group = None if dims.dp == dims.world_size else dims.group("dp")
            optimizer = shard_optimizer(optimizer, stage=par.zero_stage, process_group=dp_group)
            rebalance = (
                RebalanceConfig(every=par.ep_rebalance_every, threshold=par.ep_rebalance_threshold)
                if par.ep_rebalance_every
                else None
            )
            # aux losses, expert gradients, balancing, load, expert rebalancing
            moe = MoEHooks(built.holder, dims, optimizer=optimizer, rebalance=rebalance)
            scheduler = self.scheduler_factory(optimizer) if self.scheduler_factory else None
            scaler = LossScaler.from_config(par, device=device)  # fp16: dynamic loss scaling
            flat_sync = run.model_parallel and not fsdp and dims.dp > 1
            if run.model_parallel:
                compression.attach_flat(
                    dims.group("dp") if flat_sync else None,
                    positions={
                        id(p): built.order.get(S.clean_name(n), -1)
                        for n, p in built.state_module.named_parameters()
                    },
                )
            else:  # prime DDP's buckets on this rank's first batch; leave buffers as they were
                x0, y0 = self._batch(
                    self.dataset, self.train_sampler, 0, dims.data_rank(), dims.data_degree, device
                )
                saved = [b.detach().clone() for b in built.holder.buffers()]
                compression.attach(
                    built.forward, built.holder, prime=lambda: loss_fn(built.forward(x0), y0)
                )
                with torch.no_grad():
                    for b, v in zip(built.holder.buffers(), saved, strict=True):
                        b.copy_(v)
            comm = CommSetup(
                cfg.comm,
                built.forward if built.forward is not None else built.holder,
                dims=dims,
                compressed=compression.hook is not None,
                wrapped=not run.model_parallel,
            )
            stack.callback(comm.close)
            ckpt = RunCheckpoint(
                cfg.checkpoint,
                seed=cfg.seed,
                batch_size=cfg.batch_size,
                max_steps=cfg.max_steps,
                settings=computation_settings(cfg, self.settings),
                model=built.state_module,
                optimizer=optimizer,
                num_samples=len(self.dataset),
                json_state={"loss_scaler": scaler, **({"lr_scheduler": scheduler} if scheduler else {})},
                rank_state={"compression": compression.stateful},
                layout={"tp": dims.tp} if run.tp_plan is not None and run.tp_plan.prepare else None,
                sampler=self.train_sampler,
                model_info=self.model_info,
            )
            stack.callback(ckpt.close)
            start_step, losses = ckpt.resume()
            if runtime.is_main:
                layout = f"dp {dims.dp} x tp {dims.tp} x pp {dims.pp}"
                if dims.ep > 1:
                    layout += f" x ep {dims.ep}"
                if dims.pp > 1:
                    layout += f" ({par.pp_schedule}, {par.num_microbatches} micro-batches)"
                print(
                    f"torsh-dist {self.name}: {built.num_params / 1e6:.2f}M params, world size "
                    f"{runtime.world_size} ({runtime.backend}) = {layout}, global batch "
                    f"{cfg.batch_size} ({run.per_dp}/dp rank){self.describe}",
                    flush=True,
                )
            progress = Progress(
                total=cfg.max_steps, enabled=runtime.is_main and cfg.progress, desc=self.name
            )
            write = progress.write if cfg.progress else print
            dp_rank, dp_size = dims.data_rank(), dims.data_degree  # the batch splits over dp x ep
            pp_rank = dims.mesh["pp"].get_local_rank()
            # one rank per data-parallel replica counts its samples (the job's rate is the ranks' sum)
            counts = dims.mesh["tp"].get_local_rank() == 0 and pp_rank == dims.pp - 1
            monitor = StepMonitor(
                cfg.monitor,
                rank=runtime.rank,
                world_size=runtime.world_size,
                local_world_size=world.local_world_size(),
                device=device,
                max_steps=cfg.max_steps,
                samples_per_step=run.per_dp if counts else 0,
                tokens_per_step=run.per_dp * self.tokens_per_sample if counts else 0,
                params=params,
                custom_metrics=moe.metric_names,
                echo=progress.write if cfg.progress else None,
            )
            stack.callback(monitor.close)
            stack.callback(progress.close)

            def global_mean(local: torch.Tensor | None) -> torch.Tensor:
                # every tp rank of the last stage holds the same loss; the dp ranks hold their own
                value = torch.zeros((), device=device) if local is None else S.full(local.detach())
                if runtime.world_size > 1:
                    value = value.clone()
                    dist.all_reduce(value)
                return value / (dims.data_degree * dims.tp)

            def train_step(x: Any, y: Any) -> torch.Tensor | None:
                if built.pipe is not None:
                    return built.pipe.step(x, y)
                model = built.forward
                assert model is not None
                with S.loss_context(run):
                    if cfg.grad_accum == 1:
                        loss = moe.add_losses(loss_fn(model(x), y))
                        monitor.phase("forward")
                        scaler.backward(loss)  # loss.backward(), scaled for fp16
                        return loss
                    # forward and backward interleave: both count as "backward" in the monitor
                    return self._accumulate(model, moe.wrap(loss_fn), scaler, x, y, cfg.grad_accum)

            def evaluate() -> float:
                if self.val_sampler is None:
                    return float("nan")
                holder = built.holder
                holder.eval()
                if built.forward is not None:
                    built.forward.eval()
                total = torch.zeros((), device=device)
                with torch.no_grad():
                    for i in range(cfg.eval_batches):
                        step = EVAL_STEP_BASE + i if self.sampler_kind == "replacement" else i
                        x, y = self._batch(self.val_dataset, self.val_sampler, step, dp_rank, dp_size, device)
                        if built.pipe is not None:
                            local = built.pipe.evaluate(x, y)
                        else:
                            with S.loss_context(run):
                                local = S.full(loss_fn(built.forward(x), y))  # type: ignore[misc]
                        if local is not None:
                            total += local.detach()
                holder.train()
                if built.forward is not None:
                    built.forward.train()
                return float(global_mean(total / cfg.eval_batches))

            val_loss = float("nan")
            val_history: list[tuple[int, float]] = []  # (step, val loss) of each evaluation
            loop_time, first_step_at = 0.0, float("nan")
            for step in range(start_step, cfg.max_steps):
                t0 = time.perf_counter()
                monitor.step_begin(step)
                lr = self._set_lr(optimizer, step)
                x, y = self._batch(self.dataset, self.train_sampler, step, dp_rank, dp_size, device)
                monitor.phase("data")
                optimizer.zero_grad(set_to_none=True)
                loss = train_step(x, y)
                monitor.phase("backward")
                if dims.tp > 1:  # sequence-parallel norms' Partial gradients: one all-reduce over tp
                    reduce_partial_grads(params)
                moe.reduce_expert_grads()  # ep > 1: sum over the experts' dp group, / (dp * ep)
                if flat_sync:  # dp exchange of a model-parallel run (FSDP2 and DDP do their own)
                    reduce = compression.reduce_flat if compression.hook is not None else None
                    sync_grads(params, dims.group("dp"), dims.dp, reduce=reduce)
                    if reduce is not None and dims.tp > 1:  # compression saw other shards per tp rank
                        average_replicated_grads(params, dims.group("tp"), dims.tp)
                    monitor.phase("comm_wait")
                grad_norm = None  # reported by --monitor when clipping computes it
                scaler.unscale(optimizer)  # fp16: true gradients before clipping
                if cfg.optim.grad_clip:
                    if moe.experts:
                        grad_norm = moe.clip(params, cfg.optim.grad_clip, dense_sharded=fsdp)
                    elif run.model_parallel:
                        pp_group = dims.group("pp") if dims.pp > 1 else None
                        grad_norm = clip_grad_norm_(params, cfg.optim.grad_clip, pp_group=pp_group)
                    else:
                        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
                scaler.step(optimizer)  # fp16: skipped on every rank if a gradient overflowed
                if scheduler is not None:
                    scheduler.step()
                moe.after_step(monitor, step + 1)  # bias balancing, load statistics, rebalancing
                monitor.phase("optimizer")
                memory.after_step(built.holder, optimizer, main=runtime.is_main, write=write)
                global_loss = float(global_mean(loss))
                if not math.isfinite(global_loss):
                    lr_note = f" (--lr, now {cfg.optim.lr})" if self.optimizer_factory is None else ""
                    raise FloatingPointError(
                        f"loss became {global_loss} at step {step + 1}; lower the learning "
                        f"rate{lr_note}"
                    )
                losses.append(global_loss)
                compression.observe_loss(global_loss)
                monitor.step_end(step + 1, loss=global_loss, lr=lr, grad_norm=grad_norm)
                loop_time += time.perf_counter() - t0
                if first_step_at != first_step_at:  # NaN: this is the first step of this process
                    first_step_at = time.time()
                ckpt.step_end(step + 1, losses)  # save if due
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps:
                    val_loss = evaluate()
                    val_history.append((step + 1, val_loss))
                    if runtime.is_main:
                        write(f"step {step + 1}: val loss {val_loss:.4f}")
                if (step + 1) % cfg.log_every == 0 or step == start_step or step + 1 == cfg.max_steps:
                    rate = cfg.batch_size * (step + 1 - start_step) / loop_time
                    fields: dict[str, Any] = (
                        {"tok_s": rate * self.tokens_per_sample}
                        if self.tokens_per_sample
                        else {"smp_s": f"{rate:.1f}"}
                    )
                    fields.update(monitor.postfix())  # the job's samples/s and the slowest rank
                    progress.update_to(step + 1, loss=global_loss, **fields)
            progress.close()
            monitor_report = monitor.finish()  # last aggregation (collective), bottleneck report
            ckpt.finish(cfg.max_steps, losses)  # final save, wait for async saves
            comm.finish(main=runtime.is_main)  # merged Chrome trace on rank 0
            val_loss = evaluate()
            if self.val_sampler is not None:
                val_history.append((cfg.max_steps, val_loss))
            if not losses:
                raise ValueError(f"nothing to train: the run is at step {start_step} of {cfg.max_steps}")
            tail = losses[-min(10, len(losses)) :]
            steps_here = len(losses) - start_step
            samples_per_s = cfg.batch_size * steps_here / loop_time if loop_time else 0.0
            result = TrainResult(
                steps=len(losses),
                losses=losses,
                initial_loss=losses[0],
                final_loss=sum(tail) / len(tail),
                val_loss=val_loss,
                val_history=val_history,
                samples_per_s=samples_per_s,
                tokens_per_s=samples_per_s * self.tokens_per_sample,
                world_size=runtime.world_size,
                wall_time_s=time.perf_counter() - started,
                first_step_unix_s=first_step_at,
                num_params=built.num_params,
                backend=runtime.backend,
                layout={"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "ep": dims.ep},
                memory=memory.summary(),
                compression=compression.summary(),
                monitor=monitor_report,
                checkpoint=ckpt.summary(),
                precision=scaler.summary(),
                moe=moe.summary(),
            )
            if runtime.is_main:  # the table, --summary-json, --plot
                report_result(
                    result,
                    summary_json=cfg.summary_json,
                    plot=cfg.monitor.plot,
                    title=f"{self.name}: {built.num_params / 1e6:.2f}M params, dp {dims.dp} x "
                    f"tp {dims.tp} x pp {dims.pp} x ep {dims.ep}",
                )
            return result

    # --- pieces of the step ----------------------------------------------------------------

    def _optimizer(self, holder: nn.Module) -> torch.optim.Optimizer:
        if self.optimizer_factory is None:
            return build_optimizer(holder, self.config.optim)
        opt = self.optimizer_factory(list(holder.parameters()))
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer factory returned {type(opt).__name__}, expected a "
                "torch.optim.Optimizer"
            )
        return opt

    def _set_lr(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        if self.optimizer_factory is not None:
            return float(optimizer.param_groups[0]["lr"])
        lr = lr_at(step, optim=self.config.optim, max_steps=self.config.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _fetch(self, dataset: Any, indices: Iterable[int] | torch.Tensor) -> Any:
        batch = fetch(dataset, indices, collate=self.collate_fn)
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise ValueError(
                f"dataset items must be (input, target) pairs; a collated batch was "
                f"{type(batch).__name__}{'' if not isinstance(batch, (list, tuple)) else f' of {len(batch)}'}"
            )
        return batch

    def _batch(
        self,
        dataset: Any,
        sampler: GlobalSampler,
        step: int,
        rank: int,
        num_ranks: int,
        device: torch.device,
    ) -> tuple[Any, Any]:
        indices = shard(sampler.indices(step), rank=rank, num_ranks=num_ranks)
        x, y = self._fetch(dataset, indices)
        return S.to_device(x, device), S.to_device(y, device)

    @staticmethod
    def _accumulate(
        model: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        scaler: LossScaler,
        x: torch.Tensor,
        y: torch.Tensor,
        parts: int,
    ) -> torch.Tensor:
        """Forward/backward ``parts`` equal micro-batches, exchanging gradients only after the
        last; returns the mean loss (the loss of the whole batch)."""
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            raise ValueError(
                f"grad_accum {parts} splits the batch into micro-batches and needs tensor inputs "
                f"and targets, got {type(x).__name__} and {type(y).__name__}; use grad_accum 1"
            )
        total = torch.zeros((), device=x.device)
        for i, (xs, ys) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
            if i < parts - 1:
                with no_grad_sync(model):
                    loss = loss_fn(model(xs), ys)
                    scaler.backward(loss / parts)
            else:
                loss = loss_fn(model(xs), ys)
                scaler.backward(loss / parts)
            total += loss.detach()
        return total / parts

