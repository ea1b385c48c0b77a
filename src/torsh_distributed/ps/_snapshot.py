"""Atomic shard snapshots: tensors with ``torch.save`` (read back with ``weights_only=True``, so a
snapshot never unpickles code) and metadata as JSON; each file written to a temporary name then
renamed. The JSON is written last and names its tensor file, so a snapshot is complete exactly
when its JSON exists."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["write_snapshot", "read_latest", "write_json"]


def write_json(path: Path, data: dict[str, Any], *, sync: bool = True) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temporary file, fsync, rename); ``sync``
    False skips the fsync (atomic against a killed process, not against a power cut)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        if sync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_snapshot(folder: Path, generation: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write snapshot ``generation`` into ``folder``; remove older generations. Returns the JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"snap-{generation:08d}"
    tmp = folder / f".{name}.pt.tmp{os.getpid()}"
    torch.save(tensors, tmp)
    os.replace(tmp, folder / f"{name}.pt")
    meta = {**meta, "generation": generation, "tensors": f"{name}.pt"}
    write_json(folder / f"{name}.json", meta)
    for old in folder.glob("snap-*"):
        if not old.name.startswith(name):
            old.unlink(missing_ok=True)
    return folder / f"{name}.json"


def read_latest(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest complete snapshot in ``folder`` (tensors, metadata), or ``None``."""
    for meta_path in sorted(folder.glob("snap-*.json"), reverse=True):
        meta = json.loads(meta_path.read_text())
        pt = folder / meta["tensors"]
        if pt.is_file():
            return torch.load(pt, weights_only=True), meta
    return None
