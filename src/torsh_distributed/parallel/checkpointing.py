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

__all__ = ["apply_ac", "checkpointed_blocks"]


def apply_ac(blocks: nn.ModuleList, *, every: int) -> int:
    """Wrap every ``every``-th module of ``blocks`` (1 = all) in place; return how many.

    The first block of each group of ``every`` is wrapped (blocks 0, k, 2k, ...), so ``every=2``
    on 4 blocks checkpoints blocks 0 and 2.

    Args:
        blocks: The repeated units (e.g. ``GPT.blocks``); replaced in place.
        every: 0 = none, 1 = all, k = every k-th. Larger k saves less memory and recomputes less.

    Raises:
        ValueError: ``every`` < 0.
    """
    if every < 0:
        raise ValueError(f"every must be >= 0, got {every}")
    if every == 0:
        return 0
    count = 0
    for index in range(0, len(blocks), every):
        if isinstance(blocks[index], CheckpointWrapper):
            continue
        blocks[index] = checkpoint_wrapper(
            blocks[index], checkpoint_impl=CheckpointImpl.NO_REENTRANT
        )
        count += 1
    return count


def checkpointed_blocks(blocks: nn.ModuleList) -> int:
    """How many modules of ``blocks`` are checkpoint-wrapped."""
    return sum(isinstance(block, CheckpointWrapper) for block in blocks)
