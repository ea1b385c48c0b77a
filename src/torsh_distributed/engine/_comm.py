"""The engine's ``comm`` section: gradient all-reduce through the facade, traces, debug mode.

``--comm.algorithm ring|tree|hierarchical|auto|torch`` registers a DDP communication hook that
all-reduces every gradient bucket with :func:`~torsh_distributed.comm.collectives.all_reduce`
(MEAN, the chosen algorithm); empty (the default) keeps DDP's own all-reduce. ``--trace FILE``
records every collective of the facade and rank 0 writes one merged Chrome trace at the end.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torsh_distributed.comm import collectives as C
from torsh_distributed.comm import debug, profiler
from torsh_distributed.comm.config import CommConfig
from torsh_distributed.comm.dims import ParallelDims
from torsh_distributed.comm.reduce_op import ReduceOp

__all__ = ["CommSetup", "facade_hook", "node_assignment", "world_or_group"]


def node_assignment(config: CommConfig) -> list[int] | None:
    """``comm.node_assignment`` as a list (``None`` = discover nodes from host names)."""
    return [int(x) for x in config.node_assignment.split(",")] if config.node_assignment else None


def world_or_group(group: Any) -> Any:
    """``None`` for a group that spans the world (lets hierarchical/auto use ParallelDims' node
    groups, which exist for the world only), else ``group``."""
    if group is not None and dist.get_world_size(group) == dist.get_world_size():
        return None
    return group


@dataclass(slots=True)
class _HookState:
    algorithm: str
    group: Any = None


def facade_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket across ranks with the facade's chosen algorithm."""
    buf = bucket.buffer()
    C.all_reduce(buf, ReduceOp.MEAN, group=state.group, algorithm=state.algorithm)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks the hook's annotations as objects; postponed (string) annotations would fail it.
facade_hook.__annotations__["bucket"] = dist.GradBucket
facade_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


class CommSetup:
    """Applies a :class:`CommConfig` to the engine's model; :meth:`finish` writes the trace."""

    def __init__(
        self,
        config: CommConfig,
        model: torch.nn.Module,
        *,
        dims: ParallelDims,
        compressed: bool = False,
        wrapped: bool = True,
    ) -> None:
        """Args:
        dims: The run's built dims (their node groups serve ``hierarchical``/``auto``).
        compressed: A compression hook is installed and routes its sums through
            ``config.algorithm`` itself, so no facade hook is registered (DDP takes one hook).
        wrapped: The gradients go through a DDP wrapper; without one (tensor parallelism,
            pipeline stages) ``comm.algorithm`` is ignored with a warning.
        """
        self.config = config
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if config.algorithm == "auto" and distributed:
            dims.probe()
        if config.algorithm and not compressed:
            if isinstance(model, DistributedDataParallel):
                group = world_or_group(getattr(model, "process_group", None))
                try:
                    model.register_comm_hook(_HookState(config.algorithm, group), facade_hook)
                except RuntimeError as exc:
                    raise ValueError(
                        f"comm.algorithm={config.algorithm!r} needs DDP's comm hook, but another "
                        "one is installed (gradient compression?); use one of the two"
                    ) from exc
            else:
                why = "single rank, or a sharded strategy" if wrapped else "tp/pp > 1"
                warnings.warn(
                    f"comm.algorithm={config.algorithm!r} is ignored: the model is not wrapped in "
                    f"DDP ({why})",
                    stacklevel=2,
                )
        if config.debug and distributed:
            debug.enable(timeout=config.debug_timeout)
        if config.trace:
            profiler.enable()

    def close(self) -> None:
        """Leave debug mode and stop recording (idempotent; no collective: the error path)."""
        if self.config.trace and profiler.active() is not None:
            profiler.disable()
        if self.config.debug:
            debug.disable()

    def finish(self, *, main: bool) -> None:
        """Write the merged trace (collective) and print the rank-0 summary; stop debug mode."""
        if self.config.trace:
            prof = profiler.active()
            path = profiler.write_merged_trace(self.config.trace, prof)
            profiler.disable()
            if main and prof is not None:
                print(prof.format_summary(), flush=True)
                print(f"comm trace (all ranks, time-aligned): {path}", flush=True)
        if self.config.debug:
            debug.disable()
