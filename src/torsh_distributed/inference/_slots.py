"""A KV cache with one slot row per sequence and a length per row (private): what continuous
batching decodes with.

:class:`~torsh_distributed.inference.cache.KVCache` keeps a batch in lock-step (rows left-padded
to a common slot index), so a sequence cannot join a batch that is already decoding. Here each
sequence owns row ``r`` of every layer's buffers ``[max_rows, heads, max_len, head_dim]`` and
its own length: its tokens sit in slots ``[0, length)``, whatever the other rows do. A model sees
this cache through a :class:`Window` with :class:`KVCache`'s interface (``begin``,
``layer(i).update``), so any :class:`~torsh_distributed.inference.protocol.CachedCausalLM`
decodes with it unchanged:

* **prefill** (:meth:`SlotKVCache.prefill`): new rows ``[start, stop)`` feed their prompts
  right-padded to the longest; the causal mask keeps each real token from seeing the padding,
  whose slots lie past the row's length and are overwritten by its next tokens;
* **decode** (:meth:`SlotKVCache.decode`): rows ``[start, stop)`` feed one token each, written
  at their own length; the mask lets each see its ``length + 1`` slots only.

The running rows are kept in ``[0, count)``: :meth:`SlotKVCache.move` copies the last row into
a finished row's place, so every forward reads contiguous views and never gathers.
"""

from __future__ import annotations

import torch

from torsh_distributed.inference.cache import CacheStep

__all__ = ["SlotKVCache", "Window"]


class _LayerSlots:
    def __init__(self, window: Window, index: int) -> None:
        self._window = window
        self._index = index

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._window.update(self._index, keys, values)


class Window:
    """Rows ``[start, stop)`` of a :class:`SlotKVCache` for one forward (a prefill of
    right-padded prompts, or one decode step); the model calls ``begin`` and ``layer(i).update``
    on it as on a :class:`~torsh_distributed.inference.cache.KVCache`."""

    def __init__(self, cache: SlotKVCache, start: int, stop: int, new: list[int] | None) -> None:
        self.cache = cache
        self.start, self.stop = start, stop
        self.prefill = new is not None
        self._lengths = new if new is not None else cache.lengths[start:stop]
        self._width = max(self._lengths) if new is not None else 1
        self._index: torch.Tensor | None = None
        self._end = 0

    def begin(self, num_new: int, *, max_positions: int | None = None) -> CacheStep:
        device = self.cache.device
        rows = self.stop - self.start
        if num_new != self._width:
            raise ValueError(f"this forward feeds {self._width} slots per row, got {num_new}")
        if self.prefill:
            top = max(self._lengths) - 1
            positions = torch.arange(num_new, device=device).expand(rows, num_new)
            slots = torch.arange(num_new, device=device)
            mask = (slots[None, :] <= slots[:, None])[None, None]
            self._end = num_new
        else:
            top = max(self._lengths)
            lengths = torch.tensor(self._lengths, device=device)
            positions = lengths[:, None]
            self._index = lengths
            self._end = top + 1
            mask = torch.arange(self._end, device=device)[None, :] <= lengths[:, None]
            mask = mask[:, None, None, :]
        if max_positions is not None and top >= max_positions:
            raise ValueError(
                f"position {top} exceeds the model's context length (max sequence length "
                f"{max_positions})"
            )
        if self._end > self.cache.max_len:
            raise ValueError(f"the slot cache holds {self.cache.max_len} slots per row")
        return CacheStep(positions=positions, mask=mask)

    def layer(self, index: int) -> _LayerSlots:
        return _LayerSlots(self, index)

    def update(
        self, index: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_buf, v_buf = self.cache.buffers(index, keys)
        a, b = self.start, self.stop
        if self.prefill:
            k_buf[a:b, :, : self._end] = keys
            v_buf[a:b, :, : self._end] = values
        else:
            assert self._index is not None, "begin() first"
            rows = torch.arange(a, b, device=keys.device)
            k_buf[rows, :, self._index] = keys[:, :, 0]
            v_buf[rows, :, self._index] = values[:, :, 0]
        return k_buf[a:b, :, : self._end], v_buf[a:b, :, : self._end]

    def commit(self) -> None:
        """The forward succeeded: the rows' lengths include what it fed."""
        lengths = self.cache.lengths
        for i in range(self.start, self.stop):
            lengths[i] = self._lengths[i - self.start] if self.prefill else lengths[i] + 1


class SlotKVCache:
    """Keys and values of up to ``max_rows`` sequences of up to ``max_len`` tokens each, one
    row per sequence (module doc). Buffers are allocated at a layer's first update with the
    keys' heads, dtype and device (under tensor parallelism: this rank's heads).

    Memory: ``2 * layers * max_rows * heads * max_len * head_dim`` elements, reserved once.
    """

    def __init__(self, *, max_rows: int, max_len: int, device: torch.device) -> None:
        if max_rows < 1 or max_len < 1:
            raise ValueError(f"max_rows and max_len must be >= 1, got {max_rows}, {max_len}")
        self.max_rows, self.max_len, self.device = max_rows, max_len, device
        self.lengths = [0] * max_rows
        """Tokens held per row."""
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def buffers(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self._keys) <= index:
            _, heads, _, head_dim = like.shape
            shape = (self.max_rows, heads, self.max_len, head_dim)
            self._keys.append(like.new_zeros(shape))
            self._values.append(like.new_zeros(shape))
        return self._keys[index], self._values[index]

    def prefill(self, start: int, lengths: list[int]) -> Window:
        """A window over new rows ``[start, start + len(lengths))`` feeding prompts of these
        lengths, right-padded to the longest."""
        return Window(self, start, start + len(lengths), list(lengths))

    def decode(self, start: int, stop: int) -> Window:
        """A window over rows ``[start, stop)`` feeding one token each."""
        return Window(self, start, stop, None)

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s slots become row ``dst``'s (to keep the running rows contiguous)."""
        n = self.lengths[src]
        for buf in (*self._keys, *self._values):
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n
