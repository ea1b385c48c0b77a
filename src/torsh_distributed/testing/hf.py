"""A tiny Hugging Face Llama written to disk, for tests and examples (offline: no Hub).

:func:`write_tiny_llama` saves a 2-layer ``LlamaConfig`` directory (random weights optional)
with a word-level tokenizer trained by ``tokenizers`` on :func:`tiny_corpus`, and
:func:`write_jsonl` the same corpus as a ``{"text": ...}`` JSON-lines file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["tiny_corpus", "write_jsonl", "write_tiny_llama"]

_WORDS = (
    "the rank sends a shard of the gradient to its peer and waits for the sum while the "
    "optimizer steps on every parameter of the model in one process or many"
).split()


def tiny_corpus(num_lines: int = 64, *, seed: int = 0) -> list[str]:
    """Deterministic sentences over a 25-word vocabulary."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16))) for _ in range(num_lines)]


def write_jsonl(path: str | Path, lines: list[str] | None = None) -> Path:
    """``lines`` (default :func:`tiny_corpus`) as ``{"text": line}`` records."""
    out = Path(path)
    out.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines or tiny_corpus()))
    return out


def write_tiny_llama(
    directory: str | Path,
    *,
    weights: bool = False,
    hidden_size: int = 32,
    num_layers: int = 2,
    context: int = 64,
    seed: int = 0,
) -> Path:
    """Save a tiny ``LlamaForCausalLM`` config (and, with ``weights``, random weights) plus a
    word-level tokenizer (``tokenizer.json``, ``</s>`` as end of sequence) in ``directory``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(out))
    config = LlamaConfig(
        vocab_size=32,  # 25 words + 3 specials, rounded up to a multiple of 2 and 4
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if weights:
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(str(out))
    else:
        config.save_pretrained(str(out))
    return out
