"""Planning before running: memory per rank by the ZeRO paper's formulas (see :mod:`.memory`)."""

from torsh_distributed.plan.memory import (
    MemoryPlan,
    ModelStateBytes,
    activation_bytes,
    bytes_per_param,
    format_bytes,
    model_state_bytes,
    parse_stages,
    plan_memory,
    transient_bytes,
)

__all__ = [
    "MemoryPlan",
    "ModelStateBytes",
    "activation_bytes",
    "bytes_per_param",
    "format_bytes",
    "model_state_bytes",
    "parse_stages",
    "plan_memory",
    "transient_bytes",
]
