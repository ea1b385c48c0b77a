"""Parallelism applied as functions that change a model in place and return it; ``parallelize``
applies them in one documented order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.parallel.blocks import find_blocks
    from torsh_distributed.parallel.checkpointing import apply_ac
    from torsh_distributed.parallel.config import ParallelConfig
    from torsh_distributed.parallel.data import DDPOptions, apply_ddp, no_grad_sync, unwrap
    from torsh_distributed.parallel.memory import measure_model_state
    from torsh_distributed.parallel.parallelize import materialize, parallelize
    from torsh_distributed.parallel.precision import LossScaler
    from torsh_distributed.parallel.sharded import apply_fsdp, shard_optimizer
    from torsh_distributed.parallel.tp_plan import TPPlan, apply_tp_plan, resolve_tp_plan

__all__ = [
    "DDPOptions",
    "LossScaler",
    "ParallelConfig",
    "TPPlan",
    "apply_ac",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp_plan",
    "find_blocks",
    "materialize",
    "measure_model_state",
    "no_grad_sync",
    "parallelize",
    "resolve_tp_plan",
    "shard_optimizer",
    "unwrap",
]

# On first use: parallelism imports torch; the trainer's config needs only parallel.config.
__getattr__, __dir__ = exports(
    __name__,
    {
        "blocks": ("find_blocks",),
        "checkpointing": ("apply_ac",),
        "config": ("ParallelConfig",),
        "data": ("DDPOptions", "apply_ddp", "no_grad_sync", "unwrap"),
        "memory": ("measure_model_state",),
        "parallelize": ("materialize", "parallelize"),
        "precision": ("LossScaler",),
        "sharded": ("apply_fsdp", "shard_optimizer"),
        "tp_plan": ("TPPlan", "apply_tp_plan", "resolve_tp_plan"),
    },
)
