"""The built-in trainer: a small GPT on Python's own source, data parallel across ranks."""

from torsh_distributed.train.config import (
    PRESETS,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    preset,
)
from torsh_distributed.train.loop import TrainResult, train

__all__ = [
    "PRESETS",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "TrainResult",
    "preset",
    "train",
]
