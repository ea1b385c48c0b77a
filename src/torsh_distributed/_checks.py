"""Validation helpers shared by the torch-free configuration sections."""

from __future__ import annotations

__all__ = ["positive"]


def positive(owner: str, name: str, value: float) -> None:
    """``ValueError`` naming ``owner.name`` unless ``value > 0``."""
    if value <= 0:
        raise ValueError(f"{owner}.{name} must be > 0, got {value}")
