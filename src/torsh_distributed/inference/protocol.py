"""What a model must provide to be generated from: :class:`CausalLM`, or :class:`CachedCausalLM`.

Any causal language model can be generated from: a callable (an ``nn.Module``) mapping token
ids ``[batch, seq]`` (int64) to logits ``[batch, seq, vocab]`` whose position ``t`` depends only
on tokens ``<= t``. Generation then recomputes the whole sequence for every new token: exact,
simple, and ``O(n^2)`` in the sequence length (each step costs a full forward).

A model that also implements :meth:`CachedCausalLM.forward_cached` is decoded incrementally
with a :class:`~torsh_distributed.inference.cache.KVCache`: the prompts in one forward, then one
token per row per forward. The built-in GPT does; see the cache module for the three calls a
user model needs (``begin``, ``layer(i).update``, the step's mask and positions).

Optional: a ``max_seq_len`` attribute (an int) is the model's context length; generation stops
a sequence (``stop_reason == "max_length"``) rather than feed a position beyond it.

A forward may return a tuple whose first element is the logits, and logits may be a ``DTensor``
(e.g. sharded over the vocabulary by a ``loss_parallel`` tensor-parallel plan): generation
gathers them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from torsh_distributed.inference.cache import KVCache

__all__ = ["CausalLM", "CachedCausalLM", "max_seq_len_of"]


@runtime_checkable
class CausalLM(Protocol):
    """``model(tokens [batch, seq]) -> logits [batch, seq, vocab]``, causal (module doc)."""

    def __call__(self, tokens: torch.Tensor) -> Any: ...


@runtime_checkable
class CachedCausalLM(Protocol):
    """A causal LM that decodes incrementally with a KV cache."""

    def forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> Any:
        """Logits ``[batch, t, vocab]`` of ``t`` new tokens per row, given the ones already in
        ``cache`` (which it updates): equal, up to rounding, to the full forward's logits at
        those positions."""
        ...


def max_seq_len_of(model: object) -> int | None:
    """The model's ``max_seq_len`` attribute, or ``None`` when it has none.

    Raises:
        ValueError: the attribute is present but not a positive int.
    """
    value = getattr(model, "max_seq_len", None)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"the model's max_seq_len must be a positive int, got {value!r}")
    return value
