"""What a checkpoint directory holds: its ``step_*`` checkpoints, each verified against its manifest.

Read-only and free of DCP: :func:`scan` lists (``torsh-dist checkpoint list``), :func:`latest_valid`
picks what a run resumes from and what inference loads. Writing is
:class:`~torsh_distributed.checkpoint.manager.CheckpointManager`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torsh_distributed.checkpoint import manifest

__all__ = ["CheckpointInfo", "check_loadable_path", "is_step_dir", "latest_valid", "scan", "step_dir_name"]

_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of ``step`` (sorts by step)."""
    return f"step_{step:08d}"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One entry of :func:`scan`."""

    path: Path
    """The checkpoint directory."""
    step: int
    """Optimizer steps done when it was saved."""
    valid: bool
    """Result of the verification."""
    reason: str
    """Why it is invalid (empty when valid)."""
    file: str
    """File at fault (empty when valid)."""
    size_bytes: int
    """Total size of its files."""
    meta: dict[str, Any] | None
    """Its ``meta.json`` when valid."""


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_*`` directory of ``root``, newest first (nothing verified)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


_CHECKPOINT_FILES = (manifest.MARKER, manifest.MANIFEST, manifest.META, ".metadata")


def is_step_dir(path: Path) -> bool:
    """Whether ``path`` is one checkpoint (a ``step_*`` directory or one holding a checkpoint's
    files) rather than a run's checkpoint directory."""
    return path.name.startswith("step_") or any((path / f).exists() for f in _CHECKPOINT_FILES)


def check_loadable_path(path: str | Path) -> Path:
    """The checks of a checkpoint path to load that need neither hashing nor torch (what
    ``torsh-dist generate``, ``infer`` and ``serve`` refuse before importing torch): it exists,
    is a directory, and is one checkpoint or a run's directory holding at least one. Returns it.

    Raises:
        FileNotFoundError: it does not exist, or holds no checkpoint (the message says why).
        ValueError: it is a file.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no such checkpoint directory: {root}")
    if not root.is_dir():
        raise ValueError(
            f"{root} is a file, not a checkpoint directory: pass the run's --checkpoint-dir or "
            "one of its step_XXXXXXXX directories"
        )
    if not is_step_dir(root) and not _step_dirs(root):
        partial = sorted(p.name for p in root.glob(".tmp-step_*"))
        why = (
            f"only unfinished saves ({', '.join(partial)}): no save has committed yet"
            if partial
            else "it holds no step_XXXXXXXX checkpoint directories (is it the --checkpoint-dir "
            "of a torsh-dist train run?)"
        )
        raise FileNotFoundError(f"no checkpoint in {root}: {why}")
    return root


def scan(directory: str | Path, *, deep: bool = True) -> list[CheckpointInfo]:
    """Every ``step_*`` checkpoint in ``directory``, newest first, each verified.

    Args:
        directory: The checkpoint root.
        deep: Re-hash file contents (see :func:`~torsh_distributed.checkpoint.manifest.verify`).
    """
    infos = []
    for step, path in _step_dirs(Path(directory)):
        verdict = manifest.verify(path, deep=deep)
        infos.append(
            CheckpointInfo(
                path=path,
                step=step,
                valid=verdict.valid,
                reason=verdict.reason,
                file=verdict.file,
                size_bytes=_dir_size(path),
                meta=verdict.meta,
            )
        )
    return infos


def latest_valid(directory: str | Path) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """The newest checkpoint of ``directory`` that verifies (re-hashed), and the newer invalid
    ones skipped to reach it (newest first). Only checkpoints up to the chosen one are re-hashed.
    What :meth:`CheckpointManager.load` resumes from, and what inference loads."""
    skipped = []
    for info in scan(directory, deep=False):
        verdict = manifest.verify(info.path) if info.valid else None
        if verdict is not None and verdict.valid:
            return replace(info, meta=verdict.meta), skipped
        if verdict is not None:
            info = replace(info, valid=False, reason=verdict.reason, file=verdict.file)
        skipped.append(info)
    return None, skipped
