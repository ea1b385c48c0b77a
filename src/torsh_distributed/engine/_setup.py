"""Building a run: validate every setting before any collective, then the model and its step.

Everything here runs once per run. :func:`~torsh_distributed.engine._plan.plan_run` (re-exported
here) validates the layout first, on every rank alike; :func:`build_model` then builds the model
(or its pipeline stages) and applies :func:`~torsh_distributed.parallel.parallelize.parallelize`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torsh_distributed.compression.hooks import prime_buckets
from torsh_distributed.data.sampler import fetch
from torsh_distributed.engine._plan import RunPlan, plan_run
from torsh_distributed.engine._schedule import priority_wrap
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.parallel.blocks import find_blocks
from torsh_distributed.parallel.moe import moe_layers
from torsh_distributed.parallel.parallelize import (
    check_init_coverage,
    materialize,
    materialize_first,
    parallelize,
)
from torsh_distributed.parallel.pipeline import build_pipeline, check_split_points, stage_ids
from torsh_distributed.parallel.tp_plan import resolve_tp_plan

if TYPE_CHECKING:
    from torsh_distributed.parallel._pipeline_runner import PipelineRunner

__all__ = [
    "RunPlan", "BuiltModel", "Prefetch", "plan_run", "build_model", "param_order", "prime_ddp"
]

ModelSource = nn.Module | Callable[[], nn.Module]


def check_model(model: nn.Module, config: EngineConfig, run: RunPlan) -> None:
    """Checks that need the (unparallelised) model; no collectives."""
    dims = run.dims
    if run.tp_plan is not None:
        resolve_tp_plan(model, run.tp_plan, dims.tp)  # raises on a bad plan
    if config.parallel.meta_init:
        check_init_coverage(model)
    layers = list(moe_layers(model))
    if dims.ep > 1:
        if not layers:
            raise ValueError(
                f"parallel.ep={dims.ep} shards MoE experts, but {type(model).__name__} has no MoE "
                "layer (torsh_distributed.parallel.moe.MoE)"
            )
        for layer in layers:
            if layer.config.num_experts % dims.ep:
                raise ValueError(
                    f"num_experts ({layer.config.num_experts}) of an MoE layer is not divisible "
                    f"by parallel.ep ({dims.ep}): every ep rank holds num_experts / ep experts"
                )
    if layers and dims.pp > 1:
        raise ValueError(
            "MoE layers with pipeline parallelism are not built yet (their auxiliary losses live "
            "on every stage); use pp=1"
        )
    if dims.pp > 1:
        check_split_points(
            model,
            config.parallel.split_points,
            num_stages=dims.pp * config.parallel.virtual_stages,
        )


def instantiate(source: ModelSource, *, seed: int, meta: bool) -> nn.Module:
    """The model, built under ``seed`` (identical on every rank), on ``meta`` if asked."""
    if isinstance(source, nn.Module):
        if meta:
            raise ValueError(
                "parallel.meta_init needs a model factory (a function returning the model), "
                "not a built module"
            )
        return source
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = source()
    else:
        model = source()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"the model factory returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def param_order(model: nn.Module) -> dict[str, int]:
    """Index of each parameter name in the unsplit model (wrapper prefixes removed)."""
    return {clean_name(n): i for i, (n, _) in enumerate(model.named_parameters())}


def clean_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@dataclass(kw_only=True, slots=True)
class BuiltModel:
    """The parallelised model of this rank."""

    forward: nn.Module | None
    """The module to call for forward (DDP wrapper, FSDP/TP model); ``None`` with a pipeline."""
    holder: nn.Module
    """The module(s) whose parameters this rank trains (the optimizer's)."""
    state_module: nn.Module
    """What checkpoints save, under the unsplit model's names."""
    pipe: PipelineRunner | None
    """The pipeline of this rank's stages, or ``None``."""
    num_params: int
    """Parameters of the whole model (before sharding)."""
    order: dict[str, int]
    """Unsplit parameter order (compression state keys)."""

    @property
    def params(self) -> list[nn.Parameter]:
        return self.pipe.parameters() if self.pipe is not None else list(self.holder.parameters())


def build_model(
    model: nn.Module,
    config: EngineConfig,
    run: RunPlan,
    *,
    device: torch.device,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    blocks: str | None,
    meta: bool,
) -> BuiltModel:
    """Parallelise ``model`` (or build its pipeline stages); ``run.dims`` must be built."""
    par, dims = config.parallel, run.dims
    num_params = sum(p.numel() for p in model.parameters())
    order = param_order(model)
    if dims.pp > 1 and blocks is None:  # resolve once: a pruned stage may look otherwise
        try:
            blocks = find_blocks(model)[0]
        except ValueError:
            blocks = None
    if not meta and run.model_parallel and dims.world_size > 1:
        # DDP broadcasts rank 0's weights when it wraps; tp/pp runs have no DDP: the same here
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
    pp_rank = dims.mesh.get_local_rank("pp")
    stages = iter(stage_ids(pp_rank, pp=dims.pp, virtual_stages=par.virtual_stages))

    def init_seed(stage: int) -> int:
        # stages hold different layers, and (without DTensor random on CPU) FSDP shards need
        # their own draws: one seed per (stage, dp shard)
        shard_rank = dims.mesh.get_local_rank("dp") if par.zero_stage >= 2 else 0
        return config.seed + 7919 * stage + 104729 * shard_rank

    def shard(module: nn.Module, *, stage: bool) -> nn.Module:
        seed = init_seed(next(stages) if stage else 0)
        first = meta and materialize_first(par, model_parallel=run.model_parallel)
        if first:
            materialize(module, device, seed=seed)
        out = parallelize(
            module,
            dims,
            par,
            tp_plan=run.tp_plan,
            strict_plan=not stage,
            pipeline_stage=stage,
            blocks=blocks,
            device=device,
            ddp=config.comm.exchange_schedule != "priority",
        )
        if meta and not first:
            materialize(module, device, seed=seed)
        return out

    if not meta:
        model = model.to(device)
    if dims.pp > 1:
        pipe = build_pipeline(
            model,
            split_points=par.split_points,
            pp_rank=dims.mesh.get_local_rank("pp"),
            pp=dims.pp,
            group=dims.group("pp"),
            device=device,
            schedule=par.pp_schedule,
            microbatches=par.num_microbatches,
            virtual_stages=par.virtual_stages,
            loss_fn=loss_fn,
            transform=lambda stage: shard(stage, stage=True),
        )
        holder = nn.ModuleList(pipe.modules)
        return BuiltModel(
            forward=None,
            holder=holder,
            state_module=pipe.state_module(),
            pipe=pipe,
            num_params=num_params,
            order=order,
        )
    forward = shard(model, stage=False)
    if config.comm.exchange_schedule == "priority" and dims.data_degree > 1:
        forward = priority_wrap(forward, config)  # in place of DDP
    return BuiltModel(
        forward=forward,
        holder=model,
        state_module=forward,
        pipe=None,
        num_params=num_params,
        order=order,
    )


def loss_context(run: RunPlan) -> contextlib.AbstractContextManager[Any]:
    """``loss_parallel()`` when the TP plan keeps the logits sharded, else nothing."""
    if run.tp_plan is None or not run.tp_plan.loss_parallel or run.dims.tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def prime_ddp(forward: nn.Module, holder: nn.Module, loss: Callable[[], torch.Tensor]) -> bool:
    """DDP re-buckets now, not after the first step (collective; whether it ran).

    :func:`~torsh_distributed.compression.hooks.prime_buckets` on ``loss`` (one forward and
    backward of a training step's graph: its gradients dropped, random-number state kept);
    ``holder``'s buffers are put back as they were (the caller keeps other forward side effects
    out: MoE load counts, the dense-step count). The engine primes where the layout matters from
    the first step: with compression (state per bucket), and on resume, so that step ``k + 1``
    sums each gradient element across ranks in the order the uninterrupted run did (it
    re-bucketed after its step 1; at 3 ranks or more the order changes the last bits). Cost:
    one forward/backward and one all-reduce of the gradients, once per start.
    """
    saved = [b.detach().clone() for b in holder.buffers()]
    ran = prime_buckets(forward, loss)
    with torch.no_grad():
        for b, v in zip(holder.buffers(), saved, strict=True):
            b.copy_(v)
    return ran


def full(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``value`` (a DTensor's full value)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def fetch_pair(dataset: Any, indices: Iterable[int] | torch.Tensor, collate: Any) -> Any:
    """The collated batch of ``dataset[indices]``; ``ValueError`` unless it is an ``(input,
    target)`` pair."""
    batch = fetch(dataset, indices, collate=collate)
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise ValueError(
            f"dataset items must be (input, target) pairs; a collated batch was "
            f"{type(batch).__name__}{'' if not isinstance(batch, (list, tuple)) else f' of {len(batch)}'}"
        )
    return batch


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Move tensors in a (nested) batch to ``device``. ``non_blocking`` (CUDA): host tensors are
    pinned first, so the copy is queued on the stream and the call returns at once."""
    if isinstance(batch, torch.Tensor):
        if non_blocking and device.type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking=non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking=non_blocking) for v in batch)
    return copy.copy(batch)


class Prefetch:
    """The next step's batch, fetched and queued for the device while it still runs this step.

    On CUDA every step ends by reading the loss (a synchronisation), so whatever the loop does
    on the host between that read and the next forward leaves the GPU idle: fetching, collating
    and copying the batch. :meth:`ahead` does that work once the step's kernels are queued (the
    copy from pinned memory runs on the stream, behind them); :meth:`take` hands the batch over,
    or fetches it now when none was prefetched for that step (the first step, after a resume, or
    off CUDA, where there is nothing to overlap and nothing is fetched ahead). The batch of a
    step depends on the step alone (the samplers are stateless), so fetching early changes
    nothing but the time.

    Args:
        fetch: ``fetch(step, non_blocking) -> (x, y)`` on the device.
        device: The rank's device (prefetching only on CUDA).
        max_steps: No batch is fetched ahead for a step at or past this.
    """

    def __init__(
        self,
        fetch: Callable[[int, bool], tuple[Any, Any]],
        *,
        device: torch.device,
        max_steps: int,
    ) -> None:
        self._fetch, self._max_steps = fetch, max_steps
        self._on = device.type == "cuda"
        self._held: tuple[int, tuple[Any, Any]] | None = None

    def take(self, step: int) -> tuple[Any, Any]:
        held, self._held = self._held, None
        if held is not None and held[0] == step:
            return held[1]
        return self._fetch(step, False)

    def ahead(self, step: int) -> bool:
        """Fetch ``step``'s batch now (CUDA, before ``max_steps``); whether anything was done."""
        if self._on and step < self._max_steps:
            self._held = (step, self._fetch(step, True))
            return True
        return False
