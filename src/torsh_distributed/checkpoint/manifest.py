"""SHA-256 manifests and commit markers: what makes a checkpoint directory trustworthy.

A committed checkpoint directory holds, besides its data files, ``manifest.json`` (size and
SHA-256 of every other file) and ``COMMITTED`` (the step and the SHA-256 of the manifest). Both are
written only after every rank finished writing; :func:`verify` re-hashes everything and returns
the first problem it finds, naming the file and the reason, so a truncated shard, a flipped byte,
a missing rank file or a half-written directory is never mistaken for a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "MARKER",
    "META",
    "FORMAT_VERSION",
    "Verdict",
    "sha256_file",
    "write_manifest",
    "write_marker",
    "verify",
    "atomic_write_text",
]

MANIFEST = "manifest.json"
MARKER = "COMMITTED"
META = "meta.json"
FORMAT_VERSION = 1
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of :func:`verify` for one checkpoint directory."""

    path: Path
    """The checkpoint directory."""
    valid: bool
    """True when the marker, the manifest and every file check out."""
    reason: str = ""
    """Why it is invalid (empty when valid)."""
    file: str = ""
    """The file at fault, relative to ``path`` (empty when valid or not about one file)."""
    meta: dict[str, Any] | None = None
    """The parsed ``meta.json`` of a valid checkpoint."""

    def describe(self) -> str:
        """One line: ``path: valid`` or ``path: INVALID (file): reason``."""
        if self.valid:
            return f"{self.path}: valid"
        where = f" ({self.file})" if self.file else ""
        return f"{self.path}: INVALID{where}: {self.reason}"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fp:
        while chunk := fp.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and rename (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fp:
        fp.write(text)
        fp.flush()
        os.fsync(fp.fileno())
    os.replace(tmp, path)


def _data_files(directory: Path) -> list[str]:
    names = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in (MANIFEST, MARKER):
                names.append(rel.replace(os.sep, "/"))
    return sorted(names)


def write_manifest(directory: Path) -> str:
    """Hash every file of ``directory`` into ``manifest.json``; return the manifest's SHA-256."""
    files = {
        name: {"size": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        for name in _data_files(directory)
    }
    atomic_write_text(
        directory / MANIFEST,
        json.dumps({"format": FORMAT_VERSION, "algorithm": "sha256", "files": files}, indent=1),
    )
    return sha256_file(directory / MANIFEST)


def write_marker(directory: Path, *, step: int, manifest_sha256: str) -> None:
    """Write the ``COMMITTED`` marker (atomically): the last thing a commit does."""
    atomic_write_text(
        directory / MARKER, json.dumps({"step": step, "manifest_sha256": manifest_sha256}) + "\n"
    )


def _load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def verify(directory: str | os.PathLike[str], *, deep: bool = True) -> Verdict:
    """Check a checkpoint directory; never raises for a bad checkpoint, returns a :class:`Verdict`.

    Args:
        directory: A checkpoint directory (``.../step_00000010``).
        deep: Re-hash every file (the default). ``False`` checks presence and sizes only: fast,
            but a flipped byte goes unnoticed; use it for listings, never before loading.
    """
    path = Path(directory)

    def bad(reason: str, file: str = "") -> Verdict:
        return Verdict(path=path, valid=False, reason=reason, file=file)

    if not path.is_dir():
        return bad("not a directory")
    if not (path / MARKER).is_file():
        return bad("no commit marker: the save did not finish (partial checkpoint)", MARKER)
    try:
        marker = _load_json(path / MARKER)
        expected_manifest = str(marker["manifest_sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return bad(f"unreadable commit marker: {exc}", MARKER)
    if not (path / MANIFEST).is_file():
        return bad("manifest missing", MANIFEST)
    if sha256_file(path / MANIFEST) != expected_manifest:
        return bad("manifest does not match the SHA-256 recorded in the commit marker", MANIFEST)
    try:
        manifest = _load_json(path / MANIFEST)
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return bad(f"unreadable manifest: {exc}", MANIFEST)
    present = set(_data_files(path))
    for name, entry in sorted(files.items()):
        file = path / name
        if name not in present:
            return bad("listed in the manifest but missing", name)
        size = file.stat().st_size
        if size != entry.get("size"):
            return bad(f"size {size} bytes, manifest says {entry.get('size')} (truncated?)", name)
        if deep and sha256_file(file) != entry.get("sha256"):
            return bad("SHA-256 mismatch: the content changed after the commit (corrupt)", name)
    extra = sorted(present - set(files))
    if extra:
        return bad("file not in the manifest (written after the commit?)", extra[0])
    if META not in files:
        return bad("meta.json missing from the manifest", META)
    try:
        meta = _load_json(path / META)
    except (OSError, ValueError) as exc:
        return bad(f"unreadable meta.json: {exc}", META)
    if meta.get("step") != marker.get("step"):
        return bad(f"meta.json step {meta.get('step')} != marker step {marker.get('step')}", META)
    return Verdict(path=path, valid=True, meta=meta)
