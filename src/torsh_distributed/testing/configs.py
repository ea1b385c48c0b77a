"""Small trainer configurations for tests: a 4-layer, 32-wide GPT on 200 kB of corpus, a few steps.

Fast enough for multi-rank tests on CPU; callers set what their test is about (parallel layout,
compression, ...) on the returned config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torsh_distributed.train.config import TrainConfig, preset

__all__ = ["small_config", "with_checkpoints"]


def small_config(steps: int = 4) -> TrainConfig:
    """The ``tiny`` preset shrunk for tests: ``steps`` steps of global batch 8 x 32 tokens,
    4 layers of width 32, one validation batch, no progress bar."""
    cfg = preset("tiny")
    cfg.max_steps = steps
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 200_000
    cfg.model.n_layer = 4
    cfg.model.block_size = 32
    cfg.model.d_model = 32
    return cfg


def with_checkpoints(
    cfg: TrainConfig, directory: Path | str, *, every: int, **overrides: Any
) -> TrainConfig:
    """``cfg`` saving to ``directory`` every ``every`` steps, keeping all; ``overrides`` set
    further ``checkpoint.*`` fields (``resume=...``)."""
    cfg.checkpoint.dir = str(directory)
    cfg.checkpoint.every = every
    cfg.checkpoint.keep_last = 0
    for key, value in overrides.items():
        setattr(cfg.checkpoint, key, value)
    return cfg
