"""Planning before running: memory per rank by the ZeRO paper's formulas (:mod:`.memory`), the
parallel strategy for a model and cluster (:mod:`.strategy`, optionally from a measured
:mod:`.profile`), one step of a layout simulated event by event (:mod:`.simulate`) and the lr
scaling rule (:mod:`.lr_scaling`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.plan.lr_scaling import LRScaling, lr_scaling
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
    from torsh_distributed.plan.profile import Collective, Profile
    from torsh_distributed.plan.simulate import SimLayout, SimResult, rank_by_simulation, simulate
    from torsh_distributed.plan.strategy import (
        Candidate,
        StrategyConfig,
        StrategyPlan,
        plan_strategy,
    )

__all__ = [
    "Candidate",
    "Collective",
    "LRScaling",
    "Profile",
    "SimLayout",
    "SimResult",
    "StrategyConfig",
    "StrategyPlan",
    "lr_scaling",
    "plan_strategy",
    "rank_by_simulation",
    "simulate",
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

# On first use: the engine's config needs only lr_scaling's rule names, not the simulator.
__getattr__, __dir__ = exports(
    __name__,
    {
        "lr_scaling": ("LRScaling", "lr_scaling"),
        "memory": (
            "MemoryPlan", "ModelStateBytes", "activation_bytes", "bytes_per_param",
            "format_bytes", "model_state_bytes", "parse_stages", "plan_memory", "transient_bytes",
        ),
        "profile": ("Collective", "Profile"),
        "simulate": ("SimLayout", "SimResult", "rank_by_simulation", "simulate"),
        "strategy": ("Candidate", "StrategyConfig", "StrategyPlan", "plan_strategy"),
    },
)
