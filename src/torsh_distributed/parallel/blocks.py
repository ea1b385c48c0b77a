"""Where a model keeps its repeated blocks: the unit of activation checkpointing, of FSDP
sharding (``wrap=block``) and of pipeline splits.

A model's blocks are the entries of one container (``nn.ModuleList``, ``nn.ModuleDict`` or
``nn.Sequential``) whose modules are all of one type: ``GPT.blocks``, a user model's
``layers``, ``transformer.h``. :func:`find_blocks` picks the longest such container (ties: the
first in module order); a caller can name it instead.
"""

from __future__ import annotations

from torch import nn

__all__ = ["CONTAINERS", "find_blocks", "block_entries"]

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
"""Module types that hold repeated blocks."""


def block_entries(container: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(key, module)`` of a container's present entries, in order (keys survive pruning)."""
    return [(k, m) for k, m in container._modules.items() if m is not None]


def _unwrapped_type(module: nn.Module) -> type:
    inner = getattr(module, "_checkpoint_wrapped_module", None)
    return type(inner if inner is not None else module)


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """The container of ``model``'s repeated blocks and its qualified name.

    Args:
        model: Any module.
        name: The container's qualified name (``"layers"``); ``None`` = the longest container
            whose entries share one type (``""`` when the model itself is that container).

    Raises:
        ValueError: ``name`` is not a container of ``model``, or no container of blocks exists.
    """
    modules = dict(model.named_modules())
    if name is not None:
        found = modules.get(name)
        if not isinstance(found, CONTAINERS):
            kinds = ", ".join(c.__name__ for c in CONTAINERS)
            raise ValueError(
                f"{name!r} is not a container ({kinds}) of {type(model).__name__}"
            )
        return name, found
    best: tuple[str, nn.Module] | None = None
    best_len = 0
    for qual, module in modules.items():
        if not isinstance(module, CONTAINERS):
            continue
        entries = block_entries(module)
        if len(entries) < 1 or len({_unwrapped_type(m) for _, m in entries}) != 1:
            continue
        if len(entries) > best_len:
            best, best_len = (qual, module), len(entries)
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no container of repeated blocks (an nn.ModuleList, "
            "nn.ModuleDict or nn.Sequential whose modules share one type); activation "
            "checkpointing, wrap=block and pipeline splits need one"
        )
    return best
