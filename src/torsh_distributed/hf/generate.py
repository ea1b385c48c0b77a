"""Generating from a ``transformers`` causal LM with our decoding loop, KV cache and server.

:class:`HFCausalLMAdapter` wraps the model as a
:class:`~torsh_distributed.inference.protocol.CachedCausalLM`: ``forward(tokens)`` returns the
logits, ``forward_cached(tokens, cache)`` runs the model's own forward with our cache behind
transformers' ``Cache`` interface (each attention layer's ``cache.update(k, v, layer_idx)``
becomes ``cache.layer(layer_idx).update(k, v)``), our positions as ``position_ids`` and our
boolean mask as a ready 4-D ``attention_mask`` (transformers passes a 4-D mask through
unchanged). So the lock-step :class:`~torsh_distributed.inference.cache.KVCache` and the
continuous-batching slot cache of the server both decode it, with no model-specific code: any
decoder whose attention goes through ``Cache.update`` and takes ``position_ids`` works (Llama,
Mistral without a sliding window, Qwen2, ...).

:func:`hf_text_generator` adds the tokenizer (``encode`` without special tokens, ``decode``
skipping them) and makes the tokenizer's end-of-sequence token a stop token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["HFCausalLMAdapter", "load_exported", "hf_text_generator"]


class _CacheBridge:
    """transformers' ``Cache.update`` over our cache (or a slot window of it)."""

    is_compileable = False

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
        *args: Any, **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.layer(layer_idx).update(key_states, value_states)


class HFCausalLMAdapter(nn.Module):
    """A ``transformers`` causal LM as a :class:`CachedCausalLM` (module doc).

    Args:
        model: The ``transformers`` model (``...ForCausalLM``).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        positions = getattr(model.config, "max_position_embeddings", None)
        self.max_seq_len: int | None = int(positions) if positions else None
        """The model's context (``max_position_embeddings``)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits

    def forward_cached(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits of the new ``tokens`` given those already in ``cache`` (which it updates)."""
        step = cache.begin(tokens.shape[1], max_positions=self.max_seq_len)
        mask = step.mask
        if mask is None:  # one new token per row, every slot valid: attend to all of them
            mask = torch.ones(
                tokens.shape[0], 1, tokens.shape[1], int(cache.length), dtype=torch.bool,
                device=tokens.device,
            )
        out = self.model(
            input_ids=tokens, attention_mask=mask, position_ids=step.positions,
            cache=_CacheBridge(cache), use_cache=True,
        )
        return out.logits


def load_exported(
    directory: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[HFCausalLMAdapter, Any]:
    """A Hugging Face model directory (an export, or any ``save_pretrained`` one with weights)
    as ``(adapter, tokenizer)`` in eval mode.

    Raises:
        ValueError: no ``config.json`` or no tokenizer there.
    """
    from transformers import AutoModelForCausalLM

    from torsh_distributed.hf.model import load_tokenizer

    root = Path(directory)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} is not a Hugging Face model directory (no config.json)")
    tokenizer = load_tokenizer(root)
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype or torch.float32)
    return HFCausalLMAdapter(model.to(device)).eval(), tokenizer


def hf_text_generator(
    adapter: HFCausalLMAdapter, tokenizer: Any, *, skip_special_tokens: bool = True, **kwargs: Any
) -> Any:
    """A :class:`~torsh_distributed.inference.generate.TextGenerator` with the tokenizer's
    ``encode`` (no special tokens added) and ``decode`` (special tokens skipped, or kept as text
    so that a stop string can end at ``</s>``); ``kwargs`` go to it."""
    from torsh_distributed.inference.generate import TextGenerator

    return TextGenerator(
        adapter,
        encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens),
        **kwargs,
    )
