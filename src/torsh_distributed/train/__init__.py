"""The built-in trainer: a small GPT on Python's own source, one user of the engine.

``train``, ``gpt_engine`` and ``TrainResult`` load the engine on first use, so that the configs
(all ``torsh-dist train`` needs before it launches the ranks) stay quicker to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torsh_distributed.train.config import (
    PRESETS,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    preset,
)

if TYPE_CHECKING:
    from torsh_distributed.engine.result import TrainResult
    from torsh_distributed.train.trainer import gpt_engine, train

__all__ = [
    "PRESETS",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "TrainResult",
    "gpt_engine",
    "preset",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in ("train", "gpt_engine", "TrainResult"):
        from torsh_distributed.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
