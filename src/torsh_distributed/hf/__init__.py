"""Hugging Face models, tokenizers and data sets as first-class inputs, and checkpoints back out.

* :mod:`.model` — ``--model hf:PATH``: a ``transformers`` causal LM from a local
  ``save_pretrained`` directory or a ``config.json`` (:class:`~.model.HFCausalLM`), with its FSDP
  units from ``_no_split_modules``, its tensor-parallel plan translated from
  ``base_model_tp_plan`` (:func:`~.model.translate_tp_plan`) and its loss or ours;
* :mod:`.data` — ``--dataset hf:FILE``: a local jsonl / json / parquet / csv / text file read
  through ``datasets``, tokenized with the model's tokenizer and packed into fixed windows
  (:class:`~.data.PackedTokens`);
* :mod:`.export` — ``torsh-dist checkpoint export --format hf``: a training checkpoint of any
  layout written as sharded safetensors plus ``config.json`` (:func:`~.export.export_hf`).

``transformers``, ``tokenizers`` and ``datasets`` (the ``hf`` extra) are imported inside
functions: nothing here loads them until a run asks for ``hf:``. See ``docs/huggingface.md``.
"""

from __future__ import annotations

__all__ = ["PREFIX", "is_hf"]

PREFIX = "hf:"
"""What marks a ``--model`` / ``--dataset`` / ``--val-dataset`` value as a Hugging Face input."""


def is_hf(spec: str) -> bool:
    """Whether a factory spec names a Hugging Face input (``hf:PATH``)."""
    return spec.startswith(PREFIX)
