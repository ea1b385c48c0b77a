"""``torsh-dist checkpoint export --format hf CKPT OUT``: a training checkpoint of a
``--model hf:`` run as a Hugging Face model directory.

The checkpoint (DCP, any world size and layout: ZeRO-3 shards, tensor-parallel shards, pipeline
stages) stores one global tensor per parameter name of the unwrapped ``transformers`` model
(:mod:`torsh_distributed.inference.load`), and its ``meta.json`` records the model's config
(``extra["model"]``, kind ``hf``). Export rebuilds that model in one process, reads every tensor
into it (verified against the SHA-256 manifest first; no process group), and writes it with
``save_pretrained``: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards of at
most ``max_shard_size`` with their index, ``config.json`` (``use_cache`` as the source config had
it), ``generation_config.json``, and the tokenizer the run trained with, when it had one. The
directory loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` (and vLLM, which reads the
same files).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torsh_distributed.checkpoint import manifest
from torsh_distributed.hf.model import HF_KIND, config_from_dict, load_tokenizer
from torsh_distributed.inference.load import find_checkpoint, load_model_state

__all__ = ["DTYPES", "ExportResult", "export_hf", "read_hf_info"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""``--dtype`` names of the exported weights."""


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What was exported, from where."""

    checkpoint: Path
    """The step directory read."""
    step: int
    world_size: int
    """World size of the run that saved it."""
    out: Path
    files: tuple[str, ...]
    """Files written to ``out``, sorted."""
    num_params: int

    def describe(self) -> str:
        shards = [f for f in self.files if f.endswith(".safetensors")]
        return (
            f"exported {self.checkpoint} (step {self.step}, saved by {self.world_size} rank(s)) "
            f"to {self.out}: {self.num_params:,} parameters in {len(shards)} safetensors "
            f"file(s); {', '.join(self.files)}"
        )


def read_hf_info(path: str | Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The checkpoint ``path`` names, its ``meta.json`` and the model info of a ``hf:`` run.

    Raises:
        FileNotFoundError, ValueError: see :func:`~torsh_distributed.inference.load.find_checkpoint`;
            a checkpoint of another model than ``--model hf:``.
    """
    step_dir = find_checkpoint(path)
    meta = json.loads((step_dir / manifest.META).read_text())
    info = dict(meta.get("extra", {}).get("model") or {})
    if info.get("kind") != HF_KIND or "config" not in info:
        raise ValueError(
            f"{step_dir} was not trained from --model hf:PATH (its model is "
            f"{info.get('kind') or 'not recorded'}): --format hf exports Hugging Face models"
        )
    return step_dir, meta, info


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    max_shard_size: str | int = "5GB",
    dtype: str = "float32",
) -> ExportResult:
    """Write the checkpoint's model as a Hugging Face directory ``out`` (see the module doc).

    Args:
        checkpoint: A run's checkpoint directory (its newest valid step) or one step directory.
        out: The directory to write; must not exist or be empty.
        max_shard_size: Largest safetensors file (``"5GB"``, ``"200MB"`` or bytes); bigger models
            are sharded with an index, as ``save_pretrained`` does.
        dtype: Weights' dtype in the files (``float32``: as trained; ``bfloat16`` / ``float16``
            halve them, and the config records it).

    Raises:
        FileNotFoundError, ValueError: no checkpoint; not a ``hf:`` run; ``out`` is not empty; an
            unknown ``dtype``.
        CheckpointError: reading the checkpoint failed.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{target} exists and is not an empty directory: export to a new one")
    step_dir, meta, info = read_hf_info(checkpoint)
    from transformers import AutoModelForCausalLM

    config = config_from_dict(info["config"])
    # built on the CPU, not on meta: non-persistent buffers (rotary frequencies) are computed at
    # construction and are not in any state dict
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_model_state(model, step_dir)
    model.to(DTYPES[dtype])
    model.config.use_cache = bool(info["config"].get("use_cache", True))
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(target), max_shard_size=max_shard_size)
    tokenizer_dir = info.get("tokenizer") or ""
    if tokenizer_dir and Path(tokenizer_dir).is_dir():
        load_tokenizer(tokenizer_dir).save_pretrained(str(target))
    elif tokenizer_dir:
        warnings.warn(
            f"the run's tokenizer directory {tokenizer_dir} is gone: {target} has no tokenizer "
            "(save one there with tokenizer.save_pretrained)",
            stacklevel=2,
        )
    return ExportResult(
        checkpoint=step_dir,
        step=int(meta["step"]),
        world_size=int(meta.get("world_size", 1)),
        out=target,
        files=tuple(sorted(p.name for p in target.iterdir())),
        num_params=sum(p.numel() for p in model.parameters()),
    )
