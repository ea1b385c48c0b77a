"""The built-in corpus's configuration section (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DataConfig"]


def _positive(owner: str, name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{owner}.{name} must be > 0, got {value}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The corpus: text of the Python standard library's ``.py`` files, read at run time."""

    max_bytes: int = 1_000_000
    """Read at most this many bytes of source (files in sorted order). Bigger = slower start."""
    val_percent: int = 5
    """Percent of files (chosen by a hash of the file name) held out for validation."""
    root: str = ""
    """Directory to read ``.py`` files from; empty = this Python's standard library."""

    def __post_init__(self) -> None:
        _positive("data", "max_bytes", self.max_bytes)
        if not 0 < self.val_percent < 100:
            raise ValueError(f"data.val_percent must be in (0, 100), got {self.val_percent}")
