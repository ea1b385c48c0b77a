"""One call of :meth:`Engine.fit <torsh_distributed.engine.engine.Engine.fit>` (private).

:class:`Run` holds everything a run builds and reads, in four parts a reader can follow one
by one:

* :meth:`Run.setup`: validate the layout, build the model, optimizer and components (every
  resource it opens is released when the ``with`` block ends, on errors too), resume;
* :meth:`Run.step`: one optimizer step (data, forward/backward or the pipeline schedule,
  gradient exchange, clipping, optimizer), then its bookkeeping (loss, monitor, checkpoint,
  evaluation, progress);
* :meth:`Run.evaluate`: the mean validation loss over ``eval_batches`` batches;
* :meth:`Run.finish`: last aggregation, final checkpoint, final validation, the result.

The engine drives it::

    with Run(engine, runtime, started=started) as run:
        run.setup()
        for step in range(run.start_step, config.max_steps):
            run.step(step)
        return run.finish()
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from torsh_distributed.comm.dims import ParallelDims
from torsh_distributed.compression import onebit
from torsh_distributed.data.sampler import GlobalSampler, shard
from torsh_distributed.energy.tracker import EnergyTracker
from torsh_distributed.engine import _setup as S
from torsh_distributed.engine._carbon import CarbonControl
from torsh_distributed.engine._checkpoint import RunCheckpoint, computation_settings
from torsh_distributed.engine._comm import CommSetup, node_assignment
from torsh_distributed.engine._compression import GradCompression
from torsh_distributed.engine._memory import MemoryReport, planner_optimizer
from torsh_distributed.engine._moe import MoEHooks
from torsh_distributed.engine._observe import announce, lr_note, observe
from torsh_distributed.engine._schedule import METRICS as SCHEDULE_METRICS
from torsh_distributed.engine._schedule import CommSchedule
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.engine.optim import build_optimizer, lr_at
from torsh_distributed.engine.progress import Progress
from torsh_distributed.engine.result import TrainResult, report_result
from torsh_distributed.monitor.step import StepMonitor
from torsh_distributed.parallel.data import accumulate
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
from torsh_distributed.plan.lr_scaling import LRScaling
from torsh_distributed.runtime import world
from torsh_distributed.runtime.busy import usable_cores

__all__ = ["EVAL_STEP_BASE", "EngineInputs", "Run", "accumulate"]

EVAL_STEP_BASE = 1 << 40
"""Evaluation batches of a with-replacement sampler use step ids far from training steps."""

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
LossFn = Callable[[Any, Any], torch.Tensor]


class EngineInputs(Protocol):
    """What a run reads from its :class:`~torsh_distributed.engine.engine.Engine` (and never
    changes): the engine's arguments, validated, and its samplers."""

    config: EngineConfig
    model_source: nn.Module | Callable[[], nn.Module]
    dataset: Any
    val_dataset: Any
    loss_fn: LossFn
    optimizer_factory: OptimizerFactory | None
    scheduler_factory: SchedulerFactory | None
    sampler_kind: str
    collate_fn: Callable[[list[Any]], Any] | None
    tp_plan: TPPlan | Mapping[str, str | ParallelStyle] | None
    blocks: str | None
    tokens_per_sample: int
    activation_bytes: Callable[[int], int] | None
    settings: dict[str, Any]
    lr_scaling: LRScaling | None
    model_info: dict[str, Any]
    name: str
    describe: str
    train_sampler: GlobalSampler
    val_sampler: GlobalSampler | None


class Run:
    """The state of one training run on this rank; see the module doc for its life cycle.

    Args:
        engine: The engine's inputs (model source, data, loss, optimizer factory, config).
        runtime: The started process group, as :func:`~torsh_distributed.runtime.world.init`
            returned it.
        started: ``time.perf_counter()`` when ``fit`` began (the result's wall time).
    """

    # set by setup(), in this order
    plan: S.RunPlan
    dims: ParallelDims
    compression: GradCompression
    memory: MemoryReport
    loss_fn: LossFn
    built: S.BuiltModel
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    moe: MoEHooks
    scheduler: Any
    scaler: LossScaler
    flat_sync: bool
    comm: CommSetup
    ckpt: RunCheckpoint
    start_step: int
    losses: list[float]
    progress: Progress
    write: Callable[[str], None]
    monitor: StepMonitor
    energy: EnergyTracker
    carbon: CarbonControl
    schedule: CommSchedule

    def __init__(self, engine: EngineInputs, runtime: world.Runtime, *, started: float) -> None:
        self.engine, self.runtime, self.started = engine, runtime, started
        self.cfg = engine.config
        self.device = runtime.device
        self.prefetch = S.Prefetch(
            lambda step, nb: self._batch(engine.dataset, engine.train_sampler, step, nb),
            device=self.device, max_steps=self.cfg.max_steps,
        )
        self.val_history: list[tuple[int, float]] = []  # (step, val loss) of each evaluation
        self.loop_time = 0.0
        self.first_step_at = float("nan")  # unix time of this process's first step
        self._stack = contextlib.ExitStack()  # hooks, servers, saves: released on errors too

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)  # the monitor's trackers record a raised run as failed


    def setup(self) -> None:
        """Validate, build and resume; every rank calls it (collective once the groups exist).

        Raises:
            ValueError: an invalid setting (the same on every rank, before any collective).
        """
        cfg, par, engine = self.cfg, self.cfg.parallel, self.engine
        self.plan = S.plan_run(
            cfg,
            world_size=self.runtime.world_size,
            tp_plan=engine.tp_plan,
            device_type=self.device.type,
            nodes=node_assignment(cfg.comm),
        )
        self.dims = dims = self.plan.dims
        self.compression = GradCompression(
            cfg.compression, zero_stage=par.zero_stage, algorithm=cfg.comm.algorithm, seed=cfg.seed
        )
        self._stack.callback(self.compression.close)
        threads = cfg.threads or max(1, usable_cores() // world.local_world_size())  # affinity mask
        torch.set_num_threads(threads)
        activation_bytes, per_dp = engine.activation_bytes, self.plan.per_dp
        self.memory = MemoryReport(  # RSS now = the process baseline
            zero_stage=par.zero_stage,
            dp=dims.data_degree,
            optimizer=planner_optimizer(cfg.optim) if engine.optimizer_factory is None else "",
            weight_decay=cfg.optim.weight_decay > 0,
            param_dtype=par.param_dtype,
            activations=(lambda: activation_bytes(per_dp)) if activation_bytes else None,
            predict=not self.plan.model_parallel,
        )
        self._build_model()
        self._build_optimizer()
        self._attach_compression()
        # --comm-schedule priority: the optimizer steps per chunk in the exchange's thread
        self.schedule = CommSchedule(self.built.forward, self.optimizer, grad_clip=cfg.optim.grad_clip)
        self._stack.callback(self.schedule.close)
        self.comm = CommSetup(
            cfg.comm,
            self.built.forward if self.built.forward is not None else self.built.holder,
            dims=dims,
            compressed=self.compression.hook is not None,
            wrapped=not self.plan.model_parallel,
        )
        self._stack.callback(self.comm.close)
        self._resume()
        self._announce()
        self._attach_monitor()

    def _build_model(self) -> None:
        cfg, par, engine = self.cfg, self.cfg.parallel, self.engine
        model = S.instantiate(engine.model_source, seed=cfg.seed, meta=par.meta_init)
        S.check_model(model, cfg, self.plan)
        self.dims.build()  # a layout built before in this process reuses its groups
        self.loss_fn = engine.loss_fn
        # the loss runs under the forward's autocast
        if par.param_dtype != "fp32" and par.zero_stage <= 1:
            dtype = torch.bfloat16 if par.param_dtype == "bf16" else torch.float16
            self.loss_fn = torch.autocast(self.device.type, dtype=dtype)(engine.loss_fn)
        self.built = S.build_model(
            model,
            cfg,
            self.plan,
            device=self.device,
            loss_fn=self.loss_fn,
            blocks=engine.blocks,
            meta=par.meta_init,
        )
        self.params = self.built.params

    def _build_optimizer(self) -> None:
        par, dims = self.cfg.parallel, self.dims
        optimizer = self._new_optimizer(self.built.holder)
        onebit.check_layout(optimizer, zero_stage=par.zero_stage, model_parallel=self.plan.model_parallel,
                     compressed=self.compression.section.enabled)  # a factory's 1-bit optimizer
        if dims.ep > 1 or (dims.tp > 1 and par.zero_stage < 2):
            # foreach kernels reject lists mixing DTensor (tp shards, ep experts) and plain
            # tensors, or DTensors of two meshes (FSDP2's dense shards, ep experts)
            for group in optimizer.param_groups:
                group["foreach"] = False
        dp_group = None if dims.dp == dims.world_size else dims.group("dp")
        self.optimizer = shard_optimizer(optimizer, stage=par.zero_stage, process_group=dp_group)
        rebalance = (
            RebalanceConfig(every=par.ep_rebalance_every, threshold=par.ep_rebalance_threshold)
            if par.ep_rebalance_every
            else None
        )
        # aux losses, expert gradients, balancing, load, expert rebalancing
        self.moe = MoEHooks(self.built.holder, dims, optimizer=self.optimizer, rebalance=rebalance)
        factory = self.engine.scheduler_factory
        self.scheduler = factory(self.optimizer) if factory else None
        self.scaler = LossScaler.from_config(par, device=self.device)  # fp16: dynamic loss scaling

    def _new_optimizer(self, holder: nn.Module) -> torch.optim.Optimizer:
        factory = self.engine.optimizer_factory
        if factory is None:
            dims = self.dims
            group = None if dims.dp == dims.world_size else dims.group("dp")
            return build_optimizer(holder, self.cfg.optim, group=group)
        opt = factory(list(holder.parameters()))
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer factory returned {type(opt).__name__}, expected a "
                "torch.optim.Optimizer"
            )
        return opt

    def _attach_compression(self) -> None:
        dims, built, compression = self.dims, self.built, self.compression
        self.flat_sync = (
            self.plan.model_parallel and self.cfg.parallel.zero_stage < 2 and dims.dp > 1
        )
        if self.plan.model_parallel:
            compression.attach_flat(
                dims.group("dp") if self.flat_sync else None,
                positions={
                    id(p): built.order.get(S.clean_name(n), -1)
                    for n, p in built.state_module.named_parameters()
                },
            )
            return
        forward = built.forward
        assert forward is not None
        if isinstance(self.optimizer, onebit.OneBitOptimizer):  # its exchange replaces DDP's
            if isinstance(forward, nn.parallel.DistributedDataParallel):
                onebit.replace_ddp_allreduce(forward, self.optimizer)
            return
        compression.attach(forward, built.holder)
        if compression.hook is not None:  # its state is per bucket: one layout from step 1
            self._prime(0)

    def _prime(self, step: int) -> None:
        """DDP's final buckets now (S.prime_ddp), on this rank's batch of ``step``."""
        forward, moe = self.built.forward, self.moe
        if not isinstance(forward, nn.parallel.DistributedDataParallel):
            return
        x, y = self._batch(self.engine.dataset, self.engine.train_sampler, step)

        def loss() -> torch.Tensor:  # a training step's graph: the same gradient-ready order
            return moe.add_losses(self.loss_fn(forward(x), y))

        with moe.untracked(), self.compression.uncounted(), S.loss_context(self.plan):
            S.prime_ddp(forward, self.built.holder, loss)

    def _resume(self) -> None:
        cfg, engine, dims = self.cfg, self.engine, self.dims
        scheduler, tp_plan = self.scheduler, self.plan.tp_plan
        self.ckpt = RunCheckpoint(
            cfg.checkpoint,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            max_steps=cfg.max_steps,
            settings=computation_settings(cfg, engine.settings),
            model=self.built.state_module,
            optimizer=self.optimizer,
            num_samples=len(engine.dataset),
            json_state={
                "loss_scaler": self.scaler,
                **({"lr_scheduler": scheduler} if scheduler else {}),
            },
            rank_state={
                "compression": self.compression.stateful,
                "onebit": getattr(self.optimizer, "local_state", None),
            },
            layout={"tp": dims.tp} if tp_plan is not None and tp_plan.prepare else None,
            sampler=engine.train_sampler,
            model_info=engine.model_info,
        )
        self._stack.callback(self.ckpt.close)
        self.start_step, self.losses = self.ckpt.resume()
        if self.start_step and not isinstance(self.optimizer, onebit.OneBitOptimizer):
            self._prime(self.start_step)  # sum as the uninterrupted run (no-op if primed)

    def _announce(self) -> None:
        announce(self.engine, self.cfg, self.dims, self.runtime, num_params=self.built.num_params,
                 per_dp=self.plan.per_dp)

    def _attach_monitor(self) -> None:
        cfg, runtime = self.cfg, self.runtime
        seen = observe(self.engine, cfg, self.dims, runtime=runtime, per_dp=self.plan.per_dp,
                       device=self.device, params=self.params, num_params=self.built.num_params,
                       metric_names=(*self.moe.metric_names, *(SCHEDULE_METRICS if self.schedule.on else ())))
        self.progress, self.write, self.monitor, self.energy = seen
        self._stack.push(lambda kind, *_: self.monitor.close(failed=kind is not None))
        self._stack.callback(self.progress.close)
        self.energy.start()
        self.ckpt.around_save = lambda: self.schedule.drained(  # the last updates first
            lambda: self.energy.phase("checkpoint"))  # energy by phase
        self.carbon = CarbonControl(  # time shifting and scaling: rank 0 decides, every rank follows
            cfg, main=runtime.is_main, world_size=runtime.world_size, start_step=self.start_step,
            write=self.write, device=self.device, save=lambda step: self.ckpt.save_now(step, self.losses),
            reading=self.energy.reading,  # a pause's edges: energy before it is not priced in it
        )

    # --- the step --------------------------------------------------------------------------

    def step(self, step: int) -> None:
        """Train step ``step`` (0-based) on every rank, then record, save, evaluate and log.

        Raises:
            FloatingPointError: the loss became NaN or infinite.
        """
        cfg, monitor, optimizer = self.cfg, self.monitor, self.optimizer
        t0 = time.perf_counter()
        monitor.step_begin(step)
        lr = self._set_lr(step)
        x, y = self.prefetch.take(step)
        monitor.phase("data")
        if not self.schedule.on:  # the priority exchange consumes the gradients itself
            optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(x, y)
        monitor.phase("backward")
        if self.schedule.on:  # exchange, clipping and updates proceed in the background
            grad_norm = self.schedule.submit()
            self.schedule.after_step(monitor.log if monitor.on else None)  # the measured link
        else:
            self._exchange_grads()
            self.scaler.unscale(optimizer)  # fp16: true gradients before clipping
            grad_norm = self._clip()  # reported by --monitor when clipping computes it
            self.scaler.step(optimizer)  # fp16: skipped on every rank if a gradient overflowed
        if self.scheduler is not None:
            self.scheduler.step()
        self.moe.after_step(monitor, step + 1)  # bias balancing, load statistics, rebalancing
        monitor.phase("optimizer")
        if self.prefetch.ahead(step + 1):  # CUDA: while the queued kernels run (S.Prefetch)
            monitor.phase("data")
        if step == self.start_step:  # the memory measure reads the optimizer's state
            self.schedule.wait()
        self.memory.after_step(
            self.built.holder, optimizer, main=self.runtime.is_main, write=self.write
        )
        global_loss = self._record(step, loss, lr=lr, grad_norm=grad_norm)
        self.energy.step_end()  # one clock comparison; a counter read every --energy.interval s
        self.loop_time += time.perf_counter() - t0
        if self.first_step_at != self.first_step_at:  # NaN: this is the first step of this process
            self.first_step_at = time.time()
        self.ckpt.step_end(step + 1, self.losses)  # save if due
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps:
            with self.energy.phase("eval"):
                val_loss = self.evaluate()
            self.val_history.append((step + 1, val_loss))
            self.monitor.track_metrics({"val/loss": val_loss}, step=step + 1)
            if self.runtime.is_main:
                self.write(f"step {step + 1}: val loss {val_loss:.4f}")
        if (step + 1) % cfg.log_every == 0 or step == self.start_step or step + 1 == cfg.max_steps:
            self._log(step, global_loss)
        self.carbon.step_end(step + 1)  # a pause, or the end of a scaling segment (carbon.stopped)

    def _set_lr(self, step: int) -> float:
        if self.engine.optimizer_factory is not None:
            return float(self.optimizer.param_groups[0]["lr"])
        lr = lr_at(step, optim=self.cfg.optim, max_steps=self.cfg.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _forward_backward(self, x: Any, y: Any) -> torch.Tensor | None:
        """The pipeline schedule, or forward, loss and backward (micro-batched with
        ``grad_accum``); returns this rank's loss (``None`` on a stage without one)."""
        if self.built.pipe is not None:
            return self.built.pipe.step(x, y)
        model = self.built.forward
        assert model is not None
        with S.loss_context(self.plan):
            if self.cfg.grad_accum == 1:
                loss = self.moe.add_losses(self.loss_fn(model(x), y))
                self.monitor.phase("forward")
                self.scaler.backward(loss)  # loss.backward(), scaled for fp16
                return loss
            # forward and backward interleave: both count as "backward" in the monitor
            return accumulate(
                model, self.moe.wrap(self.loss_fn), self.scaler, x, y, self.cfg.grad_accum
            )

    def _exchange_grads(self) -> None:
        """The gradient exchanges the wrappers do not do themselves."""
        dims, params = self.dims, self.params
        if dims.tp > 1:  # sequence-parallel norms' Partial gradients: one all-reduce over tp
            reduce_partial_grads(params)
        self.moe.reduce_expert_grads()  # ep > 1: sum over the experts' dp group, / (dp * ep)
        if self.flat_sync:  # dp exchange of a model-parallel run (FSDP2 and DDP do their own)
            compression = self.compression
            reduce = compression.reduce_flat if compression.hook is not None else None
            sync_grads(params, dims.group("dp"), dims.dp, reduce=reduce)
            if reduce is not None and dims.tp > 1:  # compression saw other shards per tp rank
                average_replicated_grads(params, dims.group("tp"), dims.tp)
            self.monitor.phase("comm_wait")

    def _clip(self) -> torch.Tensor | None:
        """Clip to ``optim.grad_clip`` over the whole model; the norm before clipping."""
        clip, params = self.cfg.optim.grad_clip, self.params
        if not clip:
            return None
        if self.moe.experts:
            return self.moe.clip(params, clip, dense_sharded=self.cfg.parallel.zero_stage >= 2)
        if self.plan.model_parallel:
            pp_group = self.dims.group("pp") if self.dims.pp > 1 else None
            return clip_grad_norm_(params, clip, pp_group=pp_group)
        return torch.nn.utils.clip_grad_norm_(params, clip)

    def _record(
        self, step: int, loss: torch.Tensor | None, *, lr: float, grad_norm: torch.Tensor | None
    ) -> float:
        """The job's mean loss of ``step``: checked, kept, and handed to the monitor."""
        global_loss = float(self._global_mean(loss))
        if not math.isfinite(global_loss):
            user = self.engine.optimizer_factory is not None
            note = lr_note(self.cfg, self.engine.lr_scaling, user_optimizer=user)
            raise FloatingPointError(
                f"loss became {global_loss} at step {step + 1}; lower the learning rate{note}"
            )
        self.losses.append(global_loss)
        self.compression.observe_loss(global_loss)
        self.monitor.step_end(step + 1, loss=global_loss, lr=lr, grad_norm=grad_norm)
        return global_loss

    def _log(self, step: int, global_loss: float) -> None:
        rate = self.cfg.batch_size * (step + 1 - self.start_step) / self.loop_time
        tokens_per_sample = self.engine.tokens_per_sample
        fields: dict[str, Any] = (
            {"tok_s": rate * tokens_per_sample} if tokens_per_sample else {"smp_s": f"{rate:.1f}"}
        )
        fields.update(self.monitor.postfix())  # the job's samples/s and the slowest rank
        self.progress.update_to(step + 1, loss=global_loss, **fields)

    def _global_mean(self, local: torch.Tensor | None) -> torch.Tensor:
        # every tp rank of the last stage holds the same loss; the dp ranks hold their own
        value = torch.zeros((), device=self.device) if local is None else S.full(local.detach())
        if self.runtime.world_size > 1:
            value = value.clone()
            dist.all_reduce(value)
        return value / (self.dims.data_degree * self.dims.tp)

    def _batch(
        self, dataset: Any, sampler: GlobalSampler, step: int, non_blocking: bool = False
    ) -> tuple[Any, Any]:
        """This data-parallel rank's part of the global batch of ``step``, on the device (the
        batch splits over the ``dp x ep`` ranks)."""
        dims = self.dims
        indices = shard(sampler.indices(step), rank=dims.data_rank(), num_ranks=dims.data_degree)
        return S.to_device(self._fetch(dataset, indices), self.device, non_blocking=non_blocking)

    def _fetch(self, dataset: Any, indices: Iterable[int] | torch.Tensor) -> Any:
        return S.fetch_pair(dataset, indices, self.engine.collate_fn)

    # --- evaluation ------------------------------------------------------------------------

    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` validation batches (NaN without a val_dataset)."""
        engine, built, cfg = self.engine, self.built, self.cfg
        if engine.val_sampler is None:
            return float("nan")
        built.holder.eval()
        if built.forward is not None:
            built.forward.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for i in range(cfg.eval_batches):
                step = EVAL_STEP_BASE + i if engine.sampler_kind == "replacement" else i
                x, y = self._batch(engine.val_dataset, engine.val_sampler, step)
                if built.pipe is not None:
                    local = built.pipe.evaluate(x, y)
                else:
                    with S.loss_context(self.plan):
                        local = S.full(self.loss_fn(built.forward(x), y))  # type: ignore[misc]
                if local is not None:
                    total += local.detach()
        built.holder.train()
        if built.forward is not None:
            built.forward.train()
        return float(self._global_mean(total / cfg.eval_batches))

    # --- the end ---------------------------------------------------------------------------

    def finish(self) -> TrainResult:
        """Close the progress bar, aggregate, save, evaluate; the result (printed on rank 0).

        Raises:
            ValueError: no step was trained (the run resumed at ``max_steps``).
        """
        cfg, engine, dims, losses = self.cfg, self.engine, self.dims, self.losses
        self.schedule.wait()  # the last step's updates
        self.progress.close()
        monitor_report = self.monitor.finish(close=False)  # last aggregation (collective), report
        energy, carbon = self.energy.finish()  # every rank's figures (collective)
        stopped = self.carbon.stopped  # a scaling segment's end: the next segment reports
        carbon = self.carbon.summary(carbon, energy=energy, end_step=len(losses),
                                     first_step_unix_s=self.first_step_at)
        self.ckpt.finish(len(losses) if stopped else cfg.max_steps, losses)  # wait for async saves
        self.comm.finish(main=self.runtime.is_main)  # merged Chrome trace on rank 0
        val_loss = float("nan") if stopped else self.evaluate()
        if engine.val_sampler is not None:
            self.val_history.append((cfg.max_steps, val_loss))
        if not losses:
            raise ValueError(
                f"nothing to train: the run is at step {self.start_step} of {cfg.max_steps}"
            )
        steps_here = len(losses) - self.start_step
        samples_per_s = cfg.batch_size * steps_here / self.loop_time if self.loop_time else 0.0
        num_params = self.built.num_params
        result = TrainResult(
            steps=len(losses),
            losses=losses,
            initial_loss=losses[0],
            final_loss=sum(losses[-10:]) / len(losses[-10:]),
            val_loss=val_loss,
            val_history=self.val_history,
            samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * engine.tokens_per_sample,
            world_size=self.runtime.world_size,
            wall_time_s=time.perf_counter() - self.started,
            first_step_unix_s=self.first_step_at,
            num_params=num_params,
            backend=self.runtime.backend,
            layout={"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "ep": dims.ep},
            memory=self.memory.summary(),
            compression=(opt if isinstance(opt := self.optimizer, onebit.OneBitOptimizer)
                         else self.compression).summary(),  # bytes of whoever exchanges
            monitor=monitor_report,
            checkpoint=self.ckpt.summary(),
            precision=self.scaler.summary(),
            moe=self.moe.summary(),
            energy=energy,
            carbon=carbon,
            comm=self.schedule.summary(),
            lr_scaling=engine.lr_scaling.to_dict() if engine.lr_scaling else {},
        )
        if self.runtime.is_main and not stopped:  # the table, --summary-json, --plot
            report_result(
                result,
                summary_json=cfg.summary_json,
                plot=cfg.monitor.plot,
                title=f"{engine.name}: {num_params / 1e6:.2f}M params, dp {dims.dp} x "
                f"tp {dims.tp} x pp {dims.pp} x ep {dims.ep}",
            )
        self.monitor.track_metrics({"val/loss": val_loss}, step=len(losses))  # TensorBoard, MLflow
        files = (cfg.monitor.plot, cfg.monitor.report_json, cfg.monitor.trace)  # + summary.json
        self.monitor.track_summary(result.summary(), step=len(losses), artifacts=[f for f in files if f])
        self.monitor.close()
        return result

