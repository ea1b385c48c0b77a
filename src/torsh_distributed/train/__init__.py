"""The built-in trainer: a small GPT on Python's own source, one user of the engine."""

from torsh_distributed.engine.result import TrainResult
from torsh_distributed.train.config import (
    PRESETS,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    preset,
)
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
