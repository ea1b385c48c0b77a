"""A key/value cache for incremental decoding of causal attention models.

Decoding one token at a time recomputes nothing: each attention layer stores the keys and values
of the positions it has seen and the new token's query attends to them. :class:`KVCache` holds
them for a batch of sequences in *slots*: slot ``s`` of row ``b`` holds that row's token fed in
the ``s``-th position of the batch's input. Rows of different lengths are **left-padded** (the
prompts end in the same slot, so one new token per row is one new slot) and rows that finished
stop taking new slots. Both kinds of slot are *invalid*: the attention masks them, and the
row's token positions (for position embeddings) count its valid slots only, so every row is
computed as it would be alone.

A model uses the cache in three calls (see :meth:`torsh_distributed.models.gpt.GPT.forward_cached`
for the built-in GPT)::

    step = cache.begin(tokens.shape[1], max_positions=block_size)  # positions and mask
    x = embed(tokens) + pos_emb(step.positions)
    for i, layer in enumerate(layers):                  # in each attention layer:
        k, v = cache.layer(i).update(k, v)              # [B, heads, slots so far, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask)

Buffers are allocated at a layer's first :meth:`LayerKV.update` with the shape, dtype and device
of the keys it is given, so under tensor parallelism, where a rank's attention computes only its
own heads, each rank's cache holds only those heads: it is sharded with them, with no
configuration.

A cache is only valid for the sequence of forwards that filled it: after a forward that raised
halfway, start a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["KVCache", "LayerKV", "CacheStep"]


@dataclass(frozen=True, slots=True)
class CacheStep:
    """What one forward over ``t`` new slots needs: from :meth:`KVCache.begin`."""

    positions: torch.Tensor
    """Token positions ``[batch, t]`` (int64) of the new slots: the number of valid slots of
    the row before each one; 0 for an invalid (padding or finished) slot."""
    mask: torch.Tensor | None
    """Boolean attention mask ``[batch, 1, t, slots so far]`` (``True`` = attend), or ``None``
    when every new query may attend to every slot (one new token, no invalid slot)."""


class LayerKV:
    """The keys and values of one attention layer, ``[batch, heads, max_len, head_dim]`` each."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache
        self.keys: torch.Tensor | None = None
        """Key buffer, allocated at the first :meth:`update`; ``None`` before."""
        self.values: torch.Tensor | None = None
        """Value buffer, like :attr:`keys`."""

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new slots' keys and values; return every slot's so far.

        Args:
            keys: ``[batch, heads, t, head_dim]`` for the ``t`` slots of the current
                :meth:`KVCache.begin` (``heads`` = this rank's heads under tensor parallelism).
            values: Same shape as ``keys``.

        Returns:
            ``(keys, values)`` of slots ``[0, cache.length)``: views of the buffers.

        Raises:
            ValueError: no :meth:`KVCache.begin` for these slots, or shapes that differ from
                ``t`` new slots or from the first update's.
        """
        cache = self._cache
        start, end = cache.length - cache.step_slots, cache.length
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError(
                f"keys and values must both be [batch, heads, t, head_dim], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.shape[0] != cache.batch_size or keys.shape[2] != end - start:
            raise ValueError(
                f"expected keys for {cache.batch_size} rows and {end - start} new slots (the "
                f"last KVCache.begin), got shape {tuple(keys.shape)}"
            )
        if self.keys is None or self.values is None:
            batch, heads, _, head_dim = keys.shape
            shape = (batch, heads, cache.max_len, head_dim)
            self.keys = keys.new_zeros(shape)
            self.values = values.new_zeros(shape)
        elif keys.shape[1] != self.keys.shape[1] or keys.shape[3] != self.keys.shape[3]:
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} do not match this layer's cache "
                f"{tuple(self.keys.shape)}"
            )
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Keys and values of every attention layer for ``batch_size`` sequences (see module doc).

    Args:
        batch_size: Rows decoded together.
        max_len: Slots to allocate: the longest prompt plus the tokens to feed after it. Memory
            is ``2 * layers * batch * heads * max_len * head_dim`` elements (heads of this rank).
        left_pad: Per row, how many of its first slots are padding (prompts shorter than the
            longest are left-padded); ``None`` = none.
        device: Where the bookkeeping tensors live (the model's device).

    Raises:
        ValueError: ``batch_size`` or ``max_len`` < 1, or ``left_pad`` of the wrong length or
            outside ``[0, max_len)``.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        max_len: int,
        left_pad: Sequence[int] | torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        pad = torch.zeros(batch_size, dtype=torch.long, device=device)
        if left_pad is not None:
            pad = torch.as_tensor(left_pad, dtype=torch.long).to(device)
            if pad.shape != (batch_size,):
                raise ValueError(
                    f"left_pad must hold one count per row ({batch_size}), got shape "
                    f"{tuple(pad.shape)}"
                )
            if bool((pad < 0).any()) or bool((pad >= max_len).any()):
                raise ValueError(f"left_pad must be in [0, max_len={max_len}), got {pad.tolist()}")
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0
        """Slots filled so far (by every layer, once a forward has completed)."""
        self.step_slots = 0
        """Slots added by the last :meth:`begin`."""
        self._left_pad = pad
        self._padded = bool((pad > 0).any())
        self._valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self._next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._active = torch.ones(batch_size, dtype=torch.bool, device=device)
        self._layers: list[LayerKV] = []

    @property
    def next_positions(self) -> torch.Tensor:
        """Per row, the number of its valid slots (= the position of its next token)."""
        return self._next_position.clone()

    def finish(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Stop ``rows``: their later slots are invalid and their positions stop advancing.

        Their inputs in later forwards are then ignored (feed any token id, e.g. 0); the other
        rows compute exactly as without them.
        """
        index = torch.as_tensor(rows, dtype=torch.long).to(self._active.device)
        if index.numel():
            self._active[index] = False
            self._padded = True

    def layer(self, index: int) -> LayerKV:
        """The cache of attention layer ``index`` (created on first use)."""
        if index < 0:
            raise ValueError(f"layer index must be >= 0, got {index}")
        while len(self._layers) <= index:
            self._layers.append(LayerKV(self))
        return self._layers[index]

    @property
    def num_layers(self) -> int:
        """Layers that have a cache so far."""
        return len(self._layers)

    def begin(self, num_new: int, *, max_positions: int | None = None) -> CacheStep:
        """Open ``num_new`` slots for the next forward; its layers then call :meth:`LayerKV.update`.

        Args:
            num_new: New tokens per row in this forward (the prompt at prefill, then 1).
            max_positions: The model's context length: a new valid token at a position
                ``>= max_positions`` raises before anything changes.

        Returns:
            The new slots' positions and the attention mask over all slots so far.

        Raises:
            ValueError: ``num_new`` < 1, more slots than ``max_len``, or a position past
                ``max_positions``.
        """
        if num_new < 1:
            raise ValueError(f"a forward must feed at least one token per row, got {num_new}")
        start, end = self.length, self.length + num_new
        if end > self.max_len:
            raise ValueError(
                f"the KV cache holds max_len={self.max_len} slots; {start} are used and the "
                f"forward adds {num_new}"
            )
        device = self._valid.device
        slots = torch.arange(start, end, device=device)
        new_valid = self._active[:, None] & (slots[None, :] >= self._left_pad[:, None])
        counts = new_valid.long().cumsum(dim=1)
        positions = torch.where(new_valid, self._next_position[:, None] + counts - 1, 0)
        if (
            max_positions is not None
            and positions.numel()
            and int(positions.max()) >= max_positions
        ):
            raise ValueError(
                f"position {int(positions.max())} exceeds the model's context length "
                f"(max sequence length {max_positions})"
            )
        self._valid[:, start:end] = new_valid
        self._next_position += counts[:, -1]
        self.length, self.step_slots = end, num_new
        if not self._padded and num_new == 1:
            return CacheStep(positions=positions, mask=None)
        keys = torch.arange(end, device=device)
        causal = keys[None, :] <= slots[:, None]  # [t, end]
        mask = self._valid[:, None, :end] & causal[None]  # [batch, t, end]
        # an invalid query slot attends to itself: its (ignored) output stays finite, since a
        # fully masked row would give NaN, and a NaN value times a zero weight is still NaN
        mask |= keys[None, None, :] == slots[None, :, None]
        return CacheStep(positions=positions, mask=mask[:, None])
