"""The settings a checkpoint was written under, and what a resuming run changed.

:class:`~torsh_distributed.checkpoint.manager.CheckpointManager` stores the caller's settings
(flattened to dotted keys: ``optim.lr``) in ``meta.json`` beside their hash. On load, a different
hash is explained by the settings that differ, each ``name old -> new``; the caller may name
settings it expects to change (the engine: ``max_steps``, when a finished run is continued with a
larger one), which are returned but not warned about. A checkpoint from before settings were
stored can only say that the hash differs.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

__all__ = ["flatten_settings", "changed_settings", "describe_changes", "check_settings"]

_UNSET = "<unset>"


def flatten_settings(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``, values as JSON gives them back
    (tuples become lists; anything else not JSON becomes its ``str``)."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_settings(value, f"{name}."))
        else:
            out[name] = json.loads(json.dumps(value, default=str))
    return out


def changed_settings(
    saved: Mapping[str, Any], now: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """``{name: (saved value, value now)}`` for every flattened setting that differs; a setting
    only one side has is ``"<unset>"`` on the other."""
    before, after = flatten_settings(saved), flatten_settings(now)
    return {
        name: (before.get(name, _UNSET), after.get(name, _UNSET))
        for name in sorted(before.keys() | after.keys())
        if before.get(name, _UNSET) != after.get(name, _UNSET)
    }


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """``"optim.lr 0.003 -> 0.01, batch_size 8 -> 16"``."""
    return ", ".join(f"{name} {_short(old)} -> {_short(new)}" for name, (old, new) in changes.items())


def check_settings(
    meta: Mapping[str, Any],
    *,
    path: Path,
    config_hash: str,
    settings: Mapping[str, Any] | None,
    expected: Collection[str] = (),
) -> dict[str, tuple[Any, Any]]:
    """Compare a checkpoint's ``meta.json`` with this run; return the settings that changed.

    Warns (``UserWarning``) naming every changed setting when one of them is not in
    ``expected``; silent when only ``expected`` ones changed, or when either side has no hash.
    """
    saved_hash = meta.get("config_hash") or ""
    if not config_hash or not saved_hash or saved_hash == config_hash:
        return {}
    saved = meta.get("settings")
    if not isinstance(saved, Mapping) or settings is None:
        warnings.warn(
            f"checkpoint {path} was written by a run with a different configuration (hash "
            f"{saved_hash} vs {config_hash}; it does not store its settings, so they cannot be "
            "named)",
            stacklevel=3,
        )
        return {}
    changes = changed_settings(saved, settings)
    unexpected = {name: change for name, change in changes.items() if name not in expected}
    if unexpected:
        warnings.warn(
            f"checkpoint {path} was written by a run with a different configuration: "
            f"{describe_changes(changes)}",
            stacklevel=3,
        )
    elif not changes:  # equal settings, different hash: values JSON cannot tell apart
        warnings.warn(
            f"checkpoint {path} was written by a run with a different configuration (hash "
            f"{saved_hash} vs {config_hash}, although its stored settings are equal)",
            stacklevel=3,
        )
    return changes
