"""The training engine: one loop for any model, loss, optimizer and dataset.

``Engine`` and ``TrainResult`` import torch; they are loaded on first use so that the
torch-free configuration (``EngineConfig``, ``OptimConfig``) stays fast to import for the CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torsh_distributed.engine.config import EngineConfig, OptimConfig

if TYPE_CHECKING:
    from torsh_distributed.engine.engine import Engine, default_loss
    from torsh_distributed.engine.result import TrainResult

__all__ = ["Engine", "EngineConfig", "OptimConfig", "TrainResult", "default_loss"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "default_loss"):
        from torsh_distributed.engine import engine

        return getattr(engine, name)
    if name == "TrainResult":
        from torsh_distributed.engine.result import TrainResult

        return TrainResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
