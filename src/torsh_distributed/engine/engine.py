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

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from torsh_distributed.data.sampler import EpochSampler, GlobalSampler, ReplacementSampler
from torsh_distributed.engine._ft import FTRun, train_steps
from torsh_distributed.engine._run import EVAL_STEP_BASE, OptimizerFactory, Run, SchedulerFactory
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.engine.optim import scale_for_batch
from torsh_distributed.engine.result import TrainResult
from torsh_distributed.parallel.tp_plan import TPPlan
from torsh_distributed.runtime import world

__all__ = ["Engine", "default_loss", "EVAL_STEP_BASE"]


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
        if self.config.optim.lr_ref_batch and optimizer is not None:
            raise ValueError(
                "optim.lr_ref_batch scales config.optim's lr and warm-up; with an optimizer "
                "factory, scale your own lr (torsh_distributed.plan.lr_scaling gives the factor)"
            )
        # the lr rule for a batch other than the tuned one: the run then sees the scaled section
        scaled, self.lr_scaling = scale_for_batch(self.config.optim, self.config.batch_size)
        if self.lr_scaling is not None:
            self.config = dataclasses.replace(self.config, optim=scaled)
            if scaled.warmup_steps >= self.config.max_steps:
                warnings.warn(
                    f"lr scaling keeps the warm-up's samples: {scaled.warmup_steps} warm-up steps "
                    f"at global batch {self.config.batch_size}, not fewer than max_steps "
                    f"{self.config.max_steps}, so the lr never reaches {scaled.lr:.4g}",
                    stacklevel=2,
                )
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
        not launched) and shuts it down at the end. The process groups of the run's layout
        (``parallel.*`` axes) stay for the process group's lifetime and are reused by a later
        ``fit()`` with the same layout, so repeated calls do not accumulate groups.

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
        kind = FTRun if self.config.ft.enabled else Run  # replica groups: torchft's steps
        with kind(self, runtime, started=started) as run:  # releases what setup opened
            run.setup()
            for step in train_steps(run, run.start_step, self.config.max_steps):
                run.step(step)
                if run.carbon.stopped:  # carbon-aware scaling: the next segment goes on
                    break
            return run.finish()
