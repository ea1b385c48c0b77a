"""Shape of the built-in GPT (torch-free, so that the CLI validates configs fast)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelConfig"]


def _positive(owner: str, name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{owner}.{name} must be > 0, got {value}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the GPT-style character (byte) level transformer."""

    vocab_size: int = 256
    """Vocabulary size; 256 = one token per byte of the corpus."""
    block_size: int = 64
    """Context length in tokens; attention cost grows with its square."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 2
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 64
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability. 0 keeps runs bitwise reproducible across world sizes."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            _positive("model", name, getattr(self, name))
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
