"""What ``torsh-dist serve`` needs to serve a Hugging Face model: the model behind our KV cache,
its tokenizer, and its chat template.

Two sources are recognised (:func:`is_hf_source`): a Hugging Face model directory
(``config.json`` and weights, such as ``torsh-dist checkpoint export --format hf`` writes) and a
training checkpoint of a ``--model hf:`` run (its ``meta.json`` records the model's config and
tokenizer directory; the weights are read from DCP at any saved layout). Served in one process
(``--tp 1``).

Text: prompts are encoded without special tokens; completions are decoded with them, so the
end-of-sequence token appears as its text (``</s>``). The chat template is the tokenizer's own
(``apply_chat_template``) when it has one, else a plain ``role: content`` transcript; either way
the end-of-sequence text ends a chat reply. A completion ends at it when the request lists it
in ``stop`` (``stop=["</s>"]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torsh_distributed.hf.generate import HFCausalLMAdapter, hf_text_generator
from torsh_distributed.inference.chat import ChatTemplate
from torsh_distributed.inference.generate import TextGenerator

__all__ = ["is_hf_source", "load_hf_for_serving", "chat_template_of"]


def _is_hf_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def is_hf_source(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory or a checkpoint of a ``hf:`` run."""
    root = Path(path)
    if _is_hf_directory(root):
        return True
    from torsh_distributed.hf.export import read_hf_info

    try:
        read_hf_info(root)
    except (ValueError, FileNotFoundError, OSError):
        return False
    return True


def chat_template_of(tokenizer: Any) -> ChatTemplate:
    """The tokenizer's chat template, or a ``role: content`` transcript; both stop at the
    end-of-sequence text."""
    eos = getattr(tokenizer, "eos_token", None)
    stops = (eos,) if eos else ()
    if getattr(tokenizer, "chat_template", None):
        def render(messages: Sequence[Mapping[str, str]]) -> str:
            return str(tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            ))

        return ChatTemplate(render=render, stop=stops)

    def transcript(messages: Sequence[Mapping[str, str]]) -> str:
        lines = []
        for m in messages:
            who = m["role"] + (f" ({m['name']})" if m.get("name") else "")
            lines.append(f"{who}: {m.get('content') or ''}")
        return "\n".join(lines) + "\nassistant:"

    return ChatTemplate(render=transcript, stop=(*stops, "\nuser:"))


def load_hf_for_serving(
    path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[TextGenerator, dict[str, Any], ChatTemplate]:
    """``(generator, model info for /health, chat template)`` of a Hugging Face source.

    Raises:
        ValueError: not a Hugging Face source; a checkpoint whose tokenizer directory is gone.
    """
    from transformers import AutoModelForCausalLM

    from torsh_distributed.hf.model import config_from_dict, load_tokenizer

    root = Path(path)
    if _is_hf_directory(root):
        source, step = root, 0
        tokenizer = load_tokenizer(root)
        model = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32)
    else:
        from torsh_distributed.hf.export import read_hf_info
        from torsh_distributed.inference.load import load_model_state

        source, meta, info = read_hf_info(root)
        step = int(meta["step"])
        tokenizer_dir = info.get("tokenizer") or ""
        if not tokenizer_dir or not Path(tokenizer_dir).is_dir():
            raise ValueError(
                f"{source}: the run's tokenizer directory {tokenizer_dir or '(none)'} is gone; "
                "export the checkpoint (checkpoint export --format hf) and save a tokenizer there"
            )
        tokenizer = load_tokenizer(tokenizer_dir)
        model = AutoModelForCausalLM.from_config(config_from_dict(info["config"]), dtype=torch.float32)
        load_model_state(model, source)
    if dtype is not None:
        model.to(dtype)
    adapter = HFCausalLMAdapter(model.to(device)).eval()
    generator = hf_text_generator(adapter, tokenizer, skip_special_tokens=False)
    info_out = {
        "checkpoint": str(source),
        "step": step,
        "config": {"model_type": model.config.model_type, "vocab_size": model.config.vocab_size},
        "tokenizer": {"kind": "hf", "eos": getattr(tokenizer, "eos_token", None)},
        "eos_id": getattr(tokenizer, "eos_token_id", None),
        "dtype": str(dtype or torch.float32).removeprefix("torch."),
        "context": adapter.max_seq_len,
    }
    return generator, info_out, chat_template_of(tokenizer)
