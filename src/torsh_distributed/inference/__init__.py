"""Inference: generation with a KV cache, tensor-parallel decoding, batch generation.

* :mod:`.generate` — :func:`generate`, :func:`generate_batch`, :class:`TextGenerator`,
  :class:`GenerationResult`;
* :mod:`.config` — :class:`SamplingConfig` (greedy, temperature, top-k, top-p, seed, stops),
  torch-free; :mod:`.sampling` draws the tokens;
* :mod:`.cache` — :class:`KVCache`, the cache a model's ``forward_cached`` fills;
* :mod:`.protocol` — what a model must provide (:class:`CausalLM`, :class:`CachedCausalLM`);
* :mod:`.text` — the byte-level tokenizer of the built-in models;
* :mod:`.load` — the built-in GPT (or any model) from a training checkpoint of any layout;
* :mod:`.jobs` — :class:`~.jobs.GenerateJob` / :func:`~.jobs.run_generate` (``torsh-dist generate``);
* :mod:`.batch` — :class:`~.batch.InferJob` / :func:`~.batch.run_infer`, resumable
  data-parallel batch inference over JSONL (``torsh-dist infer``);
* :mod:`.server` — :class:`~.server.InferenceServer`, the OpenAI-compatible HTTP server
  (FastAPI on uvicorn, continuous batching; ``torsh-dist serve``), and :mod:`.chat` — the
  :class:`~.chat.ChatTemplate` its chat endpoint renders prompts with.

See ``docs/inference.md``. The names are imported on first use (torch is not needed to parse
``torsh-dist generate`` flags); ``from torsh_distributed.inference import generate`` is the
function, also once the module of the same name is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_distributed._lazy import exports

if TYPE_CHECKING:
    from torsh_distributed.inference.cache import KVCache
    from torsh_distributed.inference.config import SamplingConfig
    from torsh_distributed.inference.generate import (
        GenerationResult,
        TextGenerator,
        generate,
        generate_batch,
    )
    from torsh_distributed.inference.protocol import CachedCausalLM, CausalLM
    from torsh_distributed.inference.text import decode_bytes, encode_bytes

__all__ = [
    "CachedCausalLM",
    "CausalLM",
    "GenerationResult",
    "KVCache",
    "SamplingConfig",
    "TextGenerator",
    "decode_bytes",
    "encode_bytes",
    "generate",
    "generate_batch",
]

__getattr__, __dir__ = exports(
    __name__,
    {
        "cache": ("KVCache",),
        "config": ("SamplingConfig",),
        "generate": ("GenerationResult", "TextGenerator", "generate", "generate_batch"),
        "protocol": ("CachedCausalLM", "CausalLM"),
        "text": ("decode_bytes", "encode_bytes"),
    },
)
