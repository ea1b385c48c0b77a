"""Configuration of the built-in trainer: the engine's config plus the GPT's shape and the corpus.

Every field is documented by the docstring under it; the CLI flags are generated from these
fields (``--model.n-layer 4``, or ``--n-layer 4`` where the name is unique), so this file and
:mod:`torsh_distributed.engine.config` are the places that list what the trainer can be told.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torsh_distributed.data.config import DataConfig
from torsh_distributed.engine.config import OPTIMIZERS, EngineConfig, OptimConfig
from torsh_distributed.models.config import ModelConfig, MoESection

__all__ = [
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "OPTIMIZERS",
    "PRESETS",
    "preset",
]


@dataclass(kw_only=True, slots=True)
class TrainConfig(EngineConfig):
    """Everything one run of the built-in trainer needs: the engine's settings, model and corpus."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus selection."""
    moe: MoESection = field(default_factory=MoESection)
    """Mixture-of-Experts blocks (--moe.num-experts E --moe.top-k K, with --ep N)."""


def tiny() -> TrainConfig:
    """A minute on two CPU ranks: 2 layers, width 64, context 64; loss falls from ~5.6 to ~2.5."""
    return TrainConfig(
        model=ModelConfig(block_size=64, n_layer=2, n_head=2, d_model=64),
        data=DataConfig(max_bytes=1_000_000),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
        max_steps=200,
        batch_size=32,
    )


def small() -> TrainConfig:
    """Several minutes on CPU: 4 layers, width 128, context 128."""
    return TrainConfig(
        model=ModelConfig(block_size=128, n_layer=4, n_head=4, d_model=128),
        data=DataConfig(max_bytes=4_000_000),
        optim=OptimConfig(lr=2e-3, warmup_steps=30),
        max_steps=600,
        batch_size=32,
    )


def demo() -> TrainConfig:
    """What ``make demo`` trains: about 40 s on two CPU ranks, the set-up with the lowest
    validation loss for that compute among those measured by ``benchmarks/bench_demo.py``
    (docs/benchmarks.md): the tiny model, but 16 windows of 128 bytes a step (instead of 8 of
    256: cheaper attention, less correlated samples) on 2 MB of source; loss ~1.6."""
    return TrainConfig(
        model=ModelConfig(block_size=128, n_layer=2, n_head=2, d_model=64),
        data=DataConfig(max_bytes=2_000_000),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        max_steps=1800,
        batch_size=16,
    )


PRESETS: dict[str, Callable[[], TrainConfig]] = {"tiny": tiny, "small": small, "demo": demo}


def preset(name: str) -> TrainConfig:
    """A fresh config of the named preset (``tiny``, ``small`` or ``demo``)."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
