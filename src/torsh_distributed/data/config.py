"""The built-in corpus's configuration section (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from torsh_distributed._checks import positive as _positive

__all__ = ["DataConfig"]


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
