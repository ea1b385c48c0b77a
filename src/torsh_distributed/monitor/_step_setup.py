"""The step monitor's set-up pieces: the aggregation device, the custom metrics' names and the
job's heartbeats (:class:`~torsh_distributed.monitor.step.StepMonitor` builds them once)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torsh_distributed.monitor.config import MonitorConfig
from torsh_distributed.runtime import world

if TYPE_CHECKING:
    from torsh_distributed.elastic.watch import HealthWatch

__all__ = ["check_names", "default_device", "health_watch"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def default_device() -> torch.device | None:
    """Device of the aggregation tensor: the process group's (None = CPU)."""
    runtime = world.current()
    if runtime is not None:
        return runtime.device
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def check_names(names: Sequence[str]) -> tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(f"custom_metrics must be a sequence of names, not the string {names!r}")
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"custom_metrics: {name!r} is not a valid name (letters, digits and _, not starting "
                "with a digit)"
            )
        if name in seen:
            raise ValueError(f"custom_metrics: {name!r} is declared twice")
        seen.add(name)
    return tuple(names)


def health_watch(
    config: MonitorConfig,
    *,
    rank: int | None,
    world_size: int | None,
    echo: Callable[[str], None] | None,
) -> HealthWatch | None:
    """The job's heartbeats (multi-rank process groups with ``health_interval`` > 0)."""
    if not config.health_interval or not dist.is_initialized():
        return None
    size = dist.get_world_size() if world_size is None else world_size
    if size < 2:
        return None
    from torsh_distributed.checkpoint.progress import node_label
    from torsh_distributed.elastic.watch import HealthWatch

    return HealthWatch(
        dist.distributed_c10d._get_default_store(),
        rank=dist.get_rank() if rank is None else rank,
        world_size=size,
        interval_s=config.health_interval,
        failed_after_intervals=config.health_failed_after,
        info={"node": world.node_rank(), "host": node_label()},
        echo=echo,
    ).start()
