"""Shape of the built-in GPT (torch-free, so that the CLI validates configs fast), and the JSON
that checkpoints record about it for inference (:func:`gpt_model_info`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from torsh_distributed._checks import positive as _positive

__all__ = ["GPT_KIND", "ModelConfig", "MoESection", "gpt_config_from_info", "gpt_model_info"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the GPT-style character (byte) level transformer."""

    vocab_size: int = 256
    """Vocabulary size; 256 = one token per byte of the corpus."""
    block_size: int = 64
    """Context length in tokens; attention cost grows with its square."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 2
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 64
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability. 0 keeps runs bitwise reproducible across world sizes."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            _positive("model", name, getattr(self, name))
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True, slots=True)
class MoESection:
    """Mixture-of-Experts in the built-in GPT: the MLP of chosen blocks becomes an MoE layer
    (:class:`torsh_distributed.parallel.moe.MoE`); ``--ep N`` shards its experts over N ranks."""

    num_experts: int = 0
    """Routed experts per MoE block; 0 = a dense model (no MoE)."""
    top_k: int = 2
    """Experts per token (1 <= top_k <= num_experts): compute per token grows with it."""
    every: int = 1
    """Replace the MLP of every k-th block (blocks 0, k, 2k, ...); 1 = all blocks."""
    d_hidden: int = 0
    """Hidden width of each expert; 0 = the dense MLP's ``4 * d_model``."""
    score: str = "softmax"
    """Router scores: ``softmax`` (Switch, Mixtral) or ``sigmoid`` (DeepSeek-V3)."""
    num_shared_experts: int = 0
    """Always-on experts every token goes through (DeepSeek-MoE)."""
    capacity_factor: float = 0.0
    """0 = dropless; > 0 = each expert keeps at most ``ceil(cf * tokens * top_k / E)`` slots of
    each rank's micro-batch (the highest-weighted), the rest skip the layer."""
    aux_loss_coef: float = 0.01
    """Switch load-balancing loss weight (0 = off); added to the training loss."""
    z_loss_coef: float = 0.0
    """ST-MoE router z-loss weight (1e-3 is usual; 0 = off)."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3 aux-loss-free balancing step per optimizer step (0 = off, 1e-3 typical)."""

    def __post_init__(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"moe.num_experts must be >= 0 (0 = dense), got {self.num_experts}")
        if self.top_k < 1:
            raise ValueError(f"moe.top_k must be >= 1, got {self.top_k}")
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(
                f"moe.top_k ({self.top_k}) must not exceed moe.num_experts ({self.num_experts})"
            )
        if self.every < 1:
            raise ValueError(f"moe.every must be >= 1, got {self.every}")
        if self.d_hidden < 0 or self.num_shared_experts < 0:
            raise ValueError("moe.d_hidden and moe.num_shared_experts must be >= 0")
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"moe.score must be softmax or sigmoid, got {self.score!r}")
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


GPT_KIND = "torsh_distributed.models.gpt.GPT"
"""``kind`` of :func:`gpt_model_info`: the built-in GPT."""


def gpt_model_info(config: ModelConfig, moe: MoESection | None = None) -> dict[str, Any]:
    """What a checkpoint records about the built-in GPT so that inference can rebuild it.

    The trainer stores this JSON in every checkpoint's ``meta.json`` (``extra["model"]``);
    :func:`gpt_config_from_info` reads it back. The tokenizer is byte-level: token ``i`` is the
    byte ``i`` of UTF-8 text.
    """
    return {
        "kind": GPT_KIND,
        "config": asdict(config),
        "moe": asdict(moe if moe is not None else MoESection()),
        "tokenizer": {"kind": "bytes"},
    }


def gpt_config_from_info(info: Mapping[str, Any]) -> tuple[ModelConfig, MoESection | None]:
    """The GPT's shape and MoE section (``None`` for a dense model) from :func:`gpt_model_info`.

    Raises:
        ValueError: ``info`` describes another model, or holds fields this version does not know.
    """
    if info.get("kind") != GPT_KIND:
        raise ValueError(f"model info of kind {info.get('kind')!r}, expected {GPT_KIND!r}")
    sections: list[Any] = []
    for name, cls in (("config", ModelConfig), ("moe", MoESection)):
        values = dict(info.get(name) or {})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"model info {name!r} has fields {sorted(unknown)} that this version of "
                "torsh-distributed does not know (written by a newer version?)"
            )
        sections.append(cls(**values))
    config, moe = sections
    return config, moe if moe.enabled else None
