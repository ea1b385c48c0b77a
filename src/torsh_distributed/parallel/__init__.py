"""Parallelism applied as functions that change a model in place and return it."""

from torsh_distributed.parallel.checkpointing import apply_ac  # issue 4
from torsh_distributed.parallel.config import ParallelConfig  # issue 4
from torsh_distributed.parallel.data import apply_ddp, unwrap
from torsh_distributed.parallel.memory import measure_model_state  # issue 4
from torsh_distributed.parallel.parallelize import build_parallel_model, parallelize  # issue 4
from torsh_distributed.parallel.sharded import apply_fsdp, shard_optimizer  # issue 4
from torsh_distributed.parallel.tp_plan import TPPlan, apply_tp_plan, resolve_tp_plan  # issue 7

__all__ = ["apply_ddp", "unwrap"]
__all__ += [  # issue 4
    "ParallelConfig",
    "apply_ac",
    "apply_fsdp",
    "build_parallel_model",
    "measure_model_state",
    "parallelize",
    "shard_optimizer",
]
__all__ += ["TPPlan", "apply_tp_plan", "resolve_tp_plan"]  # issue 7
