"""The report every config importer returns: each key applied, mapped, unsupported or ignored."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from torsh_distributed.engine.config import EngineConfig

__all__ = ["ConfigReport", "KeyReport", "Status", "apply_changes", "read_json"]

Status = Literal["applied", "mapped", "unsupported", "default", "ignored"]
"""``default``: a key the config omits, given the original framework's own default (the note
says where that default comes from and any difference here; one we cannot honour is
``unsupported``). ``ignored``: a key that is not a setting (a ``_comment``) or that the original
framework does not read (a legacy section shadowed by its new name); listed, never refused by
``strict``."""
C = TypeVar("C", bound=EngineConfig)


@dataclass(frozen=True, slots=True)
class KeyReport:
    """What happened to one key of the config."""

    key: str
    """Dotted path (``zero_optimization.offload_optimizer.device``)."""
    value: Any
    """The value in the config (before resolving ``"auto"``)."""
    status: Status
    target: str
    """Our setting it became (``parallel.zero_stage``), or ``""``."""
    note: str
    """Why mapped or unsupported; the resolved value of an ``"auto"``."""


@dataclass(slots=True)
class ConfigReport:
    """Every key of an imported config, classified."""

    source: str = "config"
    """What was imported (``DeepSpeed config``, ``FairScale FullyShardedDataParallel``)."""
    entries: list[KeyReport] = field(default_factory=list)

    def by_status(self, status: Status) -> list[KeyReport]:
        return [e for e in self.entries if e.status == status]

    @property
    def unsupported(self) -> list[KeyReport]:
        return self.by_status("unsupported")

    def format(self) -> str:
        """A plain-text table, one line per key, grouped by status."""
        ignored = len(self.by_status("ignored"))
        defaults = len(self.by_status("default"))
        lines = [
            f"{self.source}: {len(self.by_status('applied'))} applied, "
            f"{len(self.by_status('mapped'))} mapped, {len(self.unsupported)} unsupported"
            + (f", {defaults} default" if defaults else "")
            + (f", {ignored} ignored" if ignored else "")
        ]
        for status in ("applied", "mapped", "unsupported", "default", "ignored"):
            for e in self.by_status(status):  # type: ignore[arg-type]
                target = f" -> {e.target}" if e.target else ""
                note = f" ({e.note})" if e.note else ""
                lines.append(
                    f"  {status:<11} {e.key} = {json.dumps(e.value, default=str)}{target}{note}"
                )
        return "\n".join(lines)

    def to_dict(self) -> list[dict[str, Any]]:
        return [
            {"key": e.key, "value": e.value, "status": e.status, "target": e.target, "note": e.note}
            for e in self.entries
        ]

    def check_strict(self, strict: bool) -> None:
        """With ``strict``, refuse any unsupported key (all listed)."""
        if strict and self.unsupported:
            listed = "; ".join(f"{e.key} ({e.note})" for e in self.unsupported)
            raise ValueError(f"--strict: unsupported {self.source} keys: {listed}")


def read_json(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; clear errors for a missing file, bad JSON or a non-object."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {str(p)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(p)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def apply_changes(base: C, changes: Mapping[str, Any]) -> C:
    """``base`` with dotted settings (``parallel.zero_stage``) replaced; validated again."""
    settings = base.to_dict()
    for target, value in changes.items():
        section, _, name = target.rpartition(".")
        (settings[section] if section else settings)[name] = value
    return type(base).from_dict(settings)
