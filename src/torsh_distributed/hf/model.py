"""``--model hf:PATH``: a ``transformers`` causal LM as a user model of the engine.

``PATH`` is a local ``save_pretrained`` directory (``config.json``, weights when present, and
``tokenizer.json``) or a ``config.json`` file. Weights (``*.safetensors``) beside the config are
loaded; without them the model is initialised at random from the config, under the run's seed
(identical on every rank). Parameters are float32 (``--param-dtype`` / ``--autocast`` set the
compute precision as for any model); ``use_cache`` is off while training.

What the model already says about itself is used instead of asking the user:

* **FSDP units** (ZeRO-3): the container whose entries are the classes the model names in
  ``_no_split_modules`` (``model.layers`` of ``LlamaDecoderLayer``), as Accelerate does.
* **Tensor parallelism** (``--tp N`` without ``--tp-plan``): the model's own plan
  (``model.tp_plan``: the config's ``base_model_tp_plan`` under the base model's prefix, the
  head's ``_tp_plan``, the vocabulary-parallel input embedding) translated style by style onto
  our :class:`~torsh_distributed.parallel.tp_plan.TPPlan` (:data:`TRANSLATED`). A plan that uses
  any other style is refused with the entry and the reason (:data:`REFUSED`); ``--tp-plan``
  still replaces it.
* **Loss**: ours by default (cross-entropy of ``output.logits`` against the packed next-token
  targets, in float32); ``--loss hf`` is the model's own ``loss_function`` (``ForCausalLMLoss``
  given the already-shifted labels). Both are the mean over tokens, so data-parallel runs equal
  one process.

Offline: nothing is downloaded. To start from a Hub model elsewhere, save it first
(``huggingface-cli download NAME --local-dir DIR``, or
``AutoModelForCausalLM.from_pretrained(NAME).save_pretrained(DIR)`` plus its tokenizer) and pass
``hf:DIR``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from torsh_distributed.hf import model_files
from torsh_distributed.parallel.blocks import CONTAINERS, block_entries
from torsh_distributed.parallel.tp_plan import TPPlan

__all__ = [
    "HF_KIND",
    "TRANSLATED",
    "REFUSED",
    "HFCausalLM",
    "load_hf_model",
    "translate_tp_plan",
    "no_split_blocks",
    "lm_loss",
    "load_tokenizer",
    "config_from_dict",
]

HF_KIND = "hf"
"""``kind`` of the model info a run of ``--model hf:`` stores in its checkpoints."""

_ROWWISE_REPLICATED_INPUT = "rowwise_replicated_input"

TRANSLATED: dict[str, str] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_replicate",
    "colwise_rep": "colwise_replicate",
    "embedding_rowwise": "embedding",
    "rowwise_split_input": _ROWWISE_REPLICATED_INPUT,
    "rowwise_rep": _ROWWISE_REPLICATED_INPUT,
}
"""transformers' TP style -> ours. Each is the same torch ``ParallelStyle`` transformers
registers: ``colwise`` = ``ColwiseParallel`` (output sharded on the last dim), ``rowwise`` =
``RowwiseParallel`` (sharded input, all-reduced output), ``colwise_gather_output`` /
``colwise_rep`` = ``ColwiseParallel(output_layouts=Replicate())``, ``embedding_rowwise`` = a
vocabulary-parallel embedding (rows sharded, looked-up rows all-reduced), ``rowwise_split_input``
/ ``rowwise_rep`` = ``RowwiseParallel(input_layouts=Replicate())`` (each rank slices its part of
a whole input)."""

REFUSED: dict[str, str] = {
    "packed_colwise": "a fused projection (gate_up or qkv) whose parts must be sharded one by one",
    "packed_rowwise": "a fused projection (gate_up or qkv) whose parts must be sharded one by one",
    "sequence_parallel": "sequence parallelism changes its neighbours' layouts too",
    "embedding_colwise": "an embedding sharded on its hidden dim with transformers' own gather",
    "replicated_with_grad_allreduce": "transformers' own gradient hook on replicated weights",
    "all_reduce": "transformers' own all-reduce hook",
    "replicate": "transformers' own replicated parameter",
    "local_params": "parameters kept local by transformers' hooks",
    "mla_kv_a_proj": "MLA's split key/value projection",
    "moe_tp_experts": "experts as one fused parameter (use --ep with a MoE of ours)",
    "moe_identity_expert": "experts as one fused parameter (use --ep with a MoE of ours)",
}
"""transformers' TP styles we do not translate, with why (any other unknown name is refused too)."""


def _style(name: str) -> str | ParallelStyle:
    ours = TRANSLATED[name]
    if ours == _ROWWISE_REPLICATED_INPUT:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    return ours


def _logits(output: Any) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"expected a transformers model output with .logits (or a logits tensor), got "
            f"{type(output).__name__}"
        )
    return logits


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Our language-model loss: mean cross-entropy of ``output.logits`` ``(B, T, V)`` against the
    next-token ``target`` ``(B, T)``, computed in float32."""
    logits = _logits(output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


@dataclass(frozen=True, slots=True)
class _ModelLoss:
    """The model's own ``loss_function`` on its logits, given the already-shifted targets."""

    fn: Callable[..., torch.Tensor]
    vocab_size: int

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.fn(
            logits=_logits(output), labels=None, vocab_size=self.vocab_size,
            shift_labels=target.contiguous(),
        )


def translate_tp_plan(model: nn.Module, plan: dict[str, str] | None = None) -> TPPlan:
    """The model's own tensor-parallel plan as a :class:`TPPlan` (patterns unchanged: both use
    ``*`` for one path segment).

    Args:
        model: A ``transformers`` model (on ``meta`` is enough).
        plan: ``{pattern: transformers style}``; ``None`` = ``model.tp_plan``.

    Raises:
        ValueError: the model ships no plan, or a style we do not translate (each such entry is
            named with its reason); tied input and output embeddings under a plan that shards
            either (checked for ``tp > 1``); a head count ``tp`` does not divide.
    """
    name = type(model).__name__
    plan = dict(plan if plan is not None else getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ValueError(
            f"{name} ships no tensor-parallel plan (base_model_tp_plan): give --tp-plan "
            "MODULE:FUNCTION"
        )
    refused = [
        f"{pattern!r}: {style!r} ({REFUSED.get(style, 'a style transformers added after this translation')})"
        for pattern, style in plan.items()
        if style not in TRANSLATED
    ]
    if refused:
        raise ValueError(
            f"{name}'s tensor-parallel plan uses styles that are not translated: "
            f"{'; '.join(refused)}. Translated: {', '.join(TRANSLATED)}; give --tp-plan "
            "MODULE:FUNCTION for this model"
        )
    rules = {pattern: _style(style) for pattern, style in plan.items()}
    config = getattr(model, "config", None)
    tied_names = set(getattr(model, "_tied_weights_keys", None) or ())

    def check(module: nn.Module, tp: int) -> None:
        if tp == 1 or config is None:
            return
        for field in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, field, None)
            if isinstance(heads, int) and heads % tp:
                raise ValueError(f"{name}: {field}={heads} is not divisible by tp={tp}")
        if getattr(config, "tie_word_embeddings", False) and tied_names:
            raise ValueError(
                f"{name} ties its input and output embeddings (tie_word_embeddings): one "
                "parameter cannot take the plan's two shardings; untie them in config.json or "
                "give --tp-plan MODULE:FUNCTION without the embeddings"
            )

    return TPPlan(rules=rules, check=check)


def no_split_blocks(model: nn.Module) -> str | None:
    """Qualified name of the container whose entries are all classes named in the model's
    ``_no_split_modules`` (its FSDP units and checkpointed blocks); ``None`` if none is."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        return None
    for qual, module in model.named_modules():
        entries = block_entries(module) if isinstance(module, CONTAINERS) else []
        if entries and all(type(m).__name__ in names for _, m in entries):
            return qual
    return None


def config_from_dict(data: dict[str, Any]) -> Any:
    """A ``transformers`` config from its ``to_dict()`` / ``config.json`` content."""
    from transformers import AutoConfig

    fields = dict(data)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError("config.json names no model_type: not a transformers config")
    return AutoConfig.for_model(model_type, **fields)


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer saved in ``directory`` (``tokenizer.json``, with ``tokenizer_config.json``
    when present).

    Raises:
        ValueError: no ``tokenizer.json`` / ``tokenizer_config.json`` there.
    """
    root = Path(directory)
    if (root / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(root))
    if (root / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"))
    raise ValueError(
        f"{root} holds no tokenizer (tokenizer.json): save one beside the model "
        "(tokenizer.save_pretrained(DIR))"
    )


class HFCausalLM:
    """A ``transformers`` causal LM named ``hf:PATH`` and what the engine needs of it.

    Raises (at construction):
        ValueError: ``PATH`` is neither a directory with ``config.json`` nor a ``.json`` file, or
            the config is not one ``transformers`` knows.
    """

    def __init__(self, spec: str) -> None:
        directory, config_file = model_files(spec)
        self.spec, self.directory, self.config_file = spec, directory.resolve(), config_file.resolve()
        try:
            data = json.loads(config_file.read_text())
            self.config = config_from_dict(data)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise ValueError(f"--model {spec}: cannot read {config_file}: {exc}") from None
        self.config_dict: dict[str, Any] = json.loads(self.config.to_json_string())
        weights = sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.bin"))
        self.has_weights = config_file.name == "config.json" and bool(weights)

    @functools.cached_property
    def meta_model(self) -> nn.Module:
        """The model on ``meta`` (no memory): for checks, the plan and the FSDP units."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)

    def build(self) -> nn.Module:
        """The model to train: weights loaded when the directory has them, else random init
        under the current seed; float32, ``use_cache`` off."""
        from transformers import AutoModelForCausalLM

        if self.has_weights:
            model = AutoModelForCausalLM.from_pretrained(
                str(self.directory), config=self.config, dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        model.config.use_cache = False
        return model

    def tp_plan(self) -> TPPlan:
        """The model's own plan, translated (see :func:`translate_tp_plan`)."""
        return translate_tp_plan(self.meta_model)

    def blocks(self) -> str | None:
        """The container of ``_no_split_modules`` blocks (see :func:`no_split_blocks`)."""
        return no_split_blocks(self.meta_model)

    def model_loss(self) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """The model's own ``loss_function`` as an engine loss ``(output, target)``."""
        return _ModelLoss(self.meta_model.loss_function, int(self.config.vocab_size))

    @property
    def tokenizer_dir(self) -> Path | None:
        """Where the model's tokenizer is (``None``: the directory holds none)."""
        found = any((self.directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        return self.directory if found else None

    def tokenizer(self) -> Any:
        """The model's tokenizer (see :func:`load_tokenizer`)."""
        return load_tokenizer(self.directory)

    def model_info(self) -> dict[str, Any]:
        """What checkpoints record to rebuild the model (export, inference)."""
        tok = self.tokenizer_dir
        return {
            "kind": HF_KIND,
            "config": self.config_dict,
            "source": str(self.directory),
            "tokenizer": str(tok) if tok is not None else "",
        }


@functools.lru_cache(maxsize=8)
def load_hf_model(spec: str) -> HFCausalLM:
    """The :class:`HFCausalLM` of ``spec`` (cached: one per process and spec)."""
    return HFCausalLM(spec)
