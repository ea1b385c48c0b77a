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

__all__ = ["CheckpointInfo", "latest_valid", "scan", "step_dir_name"]

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


def scan(directory: str | Path, *, deep: bool = True) -> list[CheckpointInfo]:
    """Every ``step_*`` checkpoint in ``directory``, newest first, each verified.

    Args:
        directory: The checkpoint root.
        deep: Re-hash file contents (see :func:`~torsh_distributed.checkpoint.manifest.verify`).
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    infos = []
    for step, path in sorted(found, reverse=True):
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
