"""What a run shows while it trains (private): the start-up line, the progress bar, the step
monitor (metrics, report, trackers) and the energy tracker, built once by
:meth:`Run.setup <torsh_distributed.engine._run.Run.setup>`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from torsh_distributed.comm.dims import ParallelDims
from torsh_distributed.energy.tracker import METRICS, EnergyTracker
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.engine.progress import Progress
from torsh_distributed.monitor.step import StepMonitor
from torsh_distributed.plan.lr_scaling import LRScaling
from torsh_distributed.runtime import world

__all__ = ["announce", "announcement", "observe"]


class _Named(Protocol):
    """The engine inputs these read (a subset of ``_run.EngineInputs``)."""

    name: str
    describe: str
    tokens_per_sample: int
    settings: dict[str, Any]
    lr_scaling: LRScaling | None


def announcement(
    engine: _Named, cfg: EngineConfig, dims: ParallelDims, *, world_size: int, backend: str,
    num_params: int, per_dp: int,
) -> str:
    """Rank 0's start-up line: parameters, world size, backend, layout and batch."""
    par = cfg.parallel
    layout = f"dp {dims.dp} x tp {dims.tp} x pp {dims.pp}"
    if dims.ep > 1:
        layout += f" x ep {dims.ep}"
    if dims.pp > 1:
        layout += f" ({par.pp_schedule}, {par.num_microbatches} micro-batches)"
    line = (
        f"torsh-dist {engine.name}: {num_params / 1e6:.2f}M params, world size {world_size} "
        f"({backend}) = {layout}, global batch {cfg.batch_size} ({per_dp}/dp rank){engine.describe}"
    )
    rule = engine.lr_scaling
    if rule is not None:  # cfg.optim holds the scaled values
        line += (
            f"\nlr scaling: {rule.rule} x{rule.factor:.4g} (global batch {cfg.batch_size} = "
            f"{rule.ratio:g}x the reference): lr {cfg.optim.lr:.4g}, warm-up "
            f"{cfg.optim.warmup_steps} steps. {rule.reason}"
        )
    return line


def lr_note(cfg: EngineConfig, rule: LRScaling | None, *, user_optimizer: bool) -> str:
    """The learning rate a diverged run names (`` (--lr ...)``): the flag's value and, when the
    engine scaled it for the batch, what it became (``cfg.optim`` holds the scaled value)."""
    if user_optimizer:
        return ""
    if rule is None or rule.factor == 1:
        return f" (--lr, now {cfg.optim.lr})"
    return (
        f" (--lr {cfg.optim.lr / rule.factor:.4g}, scaled {rule.rule} x{rule.factor:.4g} to "
        f"{cfg.optim.lr:.4g} for the global batch {cfg.batch_size}: lower --lr, or --lr-scaling)"
    )


def announce(
    engine: _Named, cfg: EngineConfig, dims: ParallelDims, runtime: world.Runtime, *,
    num_params: int, per_dp: int,
) -> None:
    """Print :func:`announcement` on the main rank."""
    if runtime.is_main:
        print(announcement(engine, cfg, dims, world_size=runtime.world_size,
                           backend=runtime.backend, num_params=num_params, per_dp=per_dp),
              flush=True)


def observe(
    engine: _Named,
    cfg: EngineConfig,
    dims: ParallelDims,
    *,
    runtime: world.Runtime,
    per_dp: int,
    device: torch.device,
    params: list[nn.Parameter],
    num_params: int,
    metric_names: Sequence[str],
) -> tuple[Progress, Callable[[str], None], StepMonitor, EnergyTracker]:
    """The progress bar, the function that writes a line beside it, the step monitor (its run
    parameters handed to the trackers) and the energy tracker (not started)."""
    progress = Progress(total=cfg.max_steps, enabled=runtime.is_main and cfg.progress, desc=engine.name)
    write: Callable[[str], None] = progress.write if cfg.progress else print
    assert dims.mesh is not None
    pp_rank = dims.mesh.get_local_rank("pp")
    # one rank per data-parallel replica counts its samples (the job's rate is the ranks' sum)
    counts = dims.mesh.get_local_rank("tp") == 0 and pp_rank == dims.pp - 1
    samples = per_dp if counts else 0
    monitor = StepMonitor(
        cfg.monitor,
        rank=runtime.rank,
        world_size=runtime.world_size,
        local_world_size=world.local_world_size(),
        device=device,
        max_steps=cfg.max_steps,
        samples_per_step=samples,
        tokens_per_step=samples * engine.tokens_per_sample,
        params=params,
        custom_metrics=(*metric_names, *(METRICS if cfg.energy.active else ())),
        echo=progress.write if cfg.progress else None,
    )
    monitor.track_params({**cfg.to_dict(), **engine.settings, "run": {  # TensorBoard, MLflow
        "model": engine.name, "num_params": num_params, "world_size": runtime.world_size,
        "backend": runtime.backend}})
    energy = EnergyTracker(  # reads a counter: losses are the same with it off
        cfg.energy, cfg.carbon, rank=runtime.rank, device=device,
        samples_per_step=samples,
        tokens_per_step=samples * engine.tokens_per_sample,
        log=monitor.log if monitor.on else None,  # Prometheus, dashboard, report
    )
    return progress, write, monitor, energy
