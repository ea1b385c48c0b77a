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

from pathlib import Path

__all__ = ["PREFIX", "is_hf", "model_files"]

PREFIX = "hf:"
"""What marks a ``--model`` / ``--dataset`` / ``--val-dataset`` value as a Hugging Face input."""


def is_hf(spec: str) -> bool:
    """Whether a factory spec names a Hugging Face input (``hf:PATH``)."""
    return spec.startswith(PREFIX)


def model_files(spec: str) -> tuple[Path, Path]:
    """``(directory, config.json)`` of ``--model hf:PATH`` (``PATH`` a ``save_pretrained``
    directory or a ``.json`` config), found without importing ``transformers`` or torch.

    Raises:
        ValueError: ``PATH`` is neither (models are not downloaded here).
    """
    path = Path(spec[len(PREFIX):] if spec.startswith(PREFIX) else spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path, path / "config.json"
    if path.is_file() and path.suffix == ".json":
        return path.parent, path
    raise ValueError(
        f"--model {spec}: not a save_pretrained directory (with config.json) or a "
        "config.json file; models are not downloaded here: save a Hub model first "
        "(huggingface-cli download NAME --local-dir DIR) and pass hf:DIR"
    )
