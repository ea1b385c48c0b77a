"""Activation checkpointing: torch's checkpoint wrapper around every block or every k-th block.

A checkpointed block saves only its input during forward and recomputes its activations during
backward: about one extra forward of those blocks for their saved activations. We use torch's
non-reentrant ``checkpoint_wrapper`` (``torch.utils.checkpoint`` underneath), which composes with
FSDP2 and DDP and strips its ``_checkpoint_wrapped_module.`` prefix from state dicts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from torsh_distributed.parallel.blocks import block_entries

__all__ = ["apply_ac", "checkpointed_blocks"]


def apply_ac(blocks: nn.Module, *, every: int) -> int:
    """Wrap every ``every``-th block of the container ``blocks`` (1 = all) in place; return how many.

    The first block of each group of ``every`` is wrapped (blocks 0, k, 2k, ...), so ``every=2``
    on 4 blocks checkpoints blocks 0 and 2. Blocks are counted by their key when keys are
    indices (a pipeline stage keeps its blocks' global indices: ``every=2`` then wraps the same
    blocks as in the unsplit model), else by position.

    Args:
        blocks: The container of repeated units (``nn.ModuleList``, ``nn.ModuleDict``,
            ``nn.Sequential``, e.g. ``GPT.blocks``); entries replaced in place.
        every: 0 = none, 1 = all, k = every k-th. Larger k saves less memory and recomputes less.

    Raises:
        ValueError: ``every`` < 0.
    """
    if every < 0:
        raise ValueError(f"every must be >= 0, got {every}")
    if every == 0:
        return 0
    count = 0
    for position, (key, block) in enumerate(block_entries(blocks)):
        index = int(key) if key.isdigit() else position
        if index % every or isinstance(block, CheckpointWrapper):
            continue
        blocks._modules[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        count += 1
    return count


def checkpointed_blocks(blocks: nn.Module) -> int:
    """How many entries of the container ``blocks`` are checkpoint-wrapped."""
    return sum(isinstance(block, CheckpointWrapper) for _, block in block_entries(blocks))
