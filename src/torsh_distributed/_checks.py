"""Validation helpers shared by the torch-free configuration sections."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_creatable_dir", "check_writable_dir", "factory_spec", "positive"]


def positive(owner: str, name: str, value: float) -> None:
    """``ValueError`` naming ``owner.name`` unless ``value > 0``."""
    if value <= 0:
        raise ValueError(f"{owner}.{name} must be > 0, got {value}")


def factory_spec(spec: str, *, what: str) -> tuple[str, str]:
    """``(MODULE, NAME)`` of a ``MODULE:NAME`` spec (``--model``, ``--dataset``, ...), checked
    without importing it: the form, and that a ``.py`` file named exists. The CLI refuses a typo
    here before it imports torch; importing the module is left to the caller.

    Raises:
        ValueError: a malformed spec, or a ``.py`` file that does not exist.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--{what} must be MODULE:FUNCTION (e.g. mypkg.nets:make_net), got {spec!r}")
    if is_file_module(module_name) and not Path(module_name).is_file():
        raise ValueError(
            f"--{what} {spec}: cannot import {module_name!r}: FileNotFoundError: no such file {module_name}"
        )
    return module_name, attr


def is_file_module(module_name: str) -> bool:
    """Whether the ``MODULE`` of a ``MODULE:NAME`` spec is a file path rather than a module name."""
    return module_name.endswith(".py") or os.sep in module_name


def check_writable_dir(path: Path, what: str) -> None:
    """Create ``path`` and check that files can be written there (``ValueError`` otherwise)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be created: {exc.strerror or exc}") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {str(path)!r} is not a writable directory")


def check_creatable_dir(path: Path, what: str) -> None:
    """Check that ``path`` is a writable directory or can be created as one (``ValueError``
    naming ``what`` otherwise), leaving nothing behind: directories this check creates to find
    out are removed again, so a refused command leaves no empty directory."""
    if path.exists():
        if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{what} {str(path)!r} is not a writable directory")
        return
    missing = [path]
    while not missing[-1].parent.exists() and missing[-1].parent != missing[-1]:
        missing.append(missing[-1].parent)
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be created: {exc.strerror or exc}") from None
    for created in missing:  # the leaf first
        created.rmdir()
