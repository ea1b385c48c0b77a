"""A small GPT-style decoder: byte embeddings, causal self-attention blocks, a linear head."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torsh_distributed.models.config import ModelConfig, MoESection
from torsh_distributed.parallel.moe import MoE, MoEConfig, moe_layers

if TYPE_CHECKING:
    from torsh_distributed.inference.cache import KVCache, LayerKV

__all__ = ["GPT", "Block", "lm_loss"]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout

    def forward(
        self,
        x: torch.Tensor,
        kv: LayerKV | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal self-attention of ``x``; with ``kv``, over the cached slots too.

        Args:
            x: ``(batch, seq, d_model)``.
            kv: This layer's KV cache (incremental decoding): ``x`` holds the new slots only.
            attn_mask: The cache step's mask (:class:`~torsh_distributed.inference.cache.CacheStep`).
        """
        batch, seq, _ = x.shape
        # chunk/-1 rather than the full width: under tensor parallelism qkv yields only
        # this rank's heads, grouped [q | k | v] per rank (see models/gpt_tp.py), so the
        # KV cache holds this rank's heads only
        q, k, v = self.qkv(x).chunk(3, dim=2)
        shape = (batch, seq, -1, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        if kv is None:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        else:
            k, v = kv.update(k, v)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0
            )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, 4 * config.d_model)
        self.down = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block; the unit for sharding and activation checkpointing."""

    def __init__(self, config: ModelConfig, moe: MoEConfig | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp: nn.Module = MLP(config) if moe is None else MoE(moe)

    def forward(
        self,
        x: torch.Tensor,
        kv: LayerKV | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), kv, attn_mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes: ``forward(idx)`` returns logits,
    ``forward(idx, targets)`` ``(logits, loss)``; splittable into pipeline stages at ``blocks.<i>``;
    ``forward_cached(idx, cache)`` decodes incrementally with a KV cache (inference)."""

    def __init__(self, config: ModelConfig, moe: MoESection | None = None) -> None:
        super().__init__()
        self.config = config
        self.moe = moe if moe is not None and moe.enabled else None
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config, self._moe_config(i)) for i in range(config.n_layer)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def _moe_config(self, index: int) -> MoEConfig | None:
        m = self.moe
        if m is None or index % m.every:
            return None
        return MoEConfig(
            num_experts=m.num_experts,
            d_model=self.config.d_model,
            d_hidden=m.d_hidden or 4 * self.config.d_model,
            top_k=m.top_k,
            score=m.score,
            num_shared_experts=m.num_shared_experts,
            capacity_factor=m.capacity_factor,
            aux_loss_coef=m.aux_loss_coef,
            z_loss_coef=m.z_loss_coef,
            bias_update_rate=m.bias_update_rate,
        )

    def reset_parameters(self) -> None:
        """GPT-2 initialisation; residual projections scaled by depth (MoE layers: their own)."""
        moe = {id(p) for layer in moe_layers(self) for p in layer.parameters()}
        for name, param in self.named_parameters():
            if id(param) in moe:
                continue
            if param.dim() >= 2:
                std = 0.02
                if name.endswith(("proj.weight", "down.weight")):
                    std = 0.02 / math.sqrt(2 * self.config.n_layer)
                nn.init.normal_(param, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        for layer in moe_layers(self):
            layer.reset_parameters()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def max_seq_len(self) -> int:
        """The context length (``config.block_size``): positions beyond it have no embedding."""
        return self.config.block_size

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits of ``idx``, or ``(logits, loss)`` when ``targets`` are given.

        Follows the pipeline contract (:mod:`torsh_distributed.parallel.pipeline`): a stage has
        some of ``tok_emb``/``pos_emb``/``drop`` (first stage), ``ln_f``/``head`` (last stage)
        set to ``None`` and a slice of ``blocks``; the parts missing are skipped, so a stage
        without the embeddings takes hidden states and one without the head returns them.

        Args:
            idx: Token ids ``(batch, seq)``, or hidden states on a stage without embeddings.
            targets: Next-token ids ``(batch, seq)``; ignored on a stage without the head.
        """
        x = idx
        if self.tok_emb is not None:
            seq = idx.shape[1]
            if seq > self.config.block_size:
                raise ValueError(
                    f"sequence length {seq} exceeds block_size {self.config.block_size}"
                )
            x = self.tok_emb(idx)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(seq, device=idx.device))
        if self.drop is not None:
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is None:
            return x
        logits = self.head(x)
        if targets is None:
            return logits
        return logits, lm_loss(logits, targets)

    def forward_cached(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of the new tokens ``idx`` given the ones already in ``cache`` (incremental
        decoding, :mod:`torsh_distributed.inference`); equal to :meth:`forward` on the whole
        sequence at those positions, up to floating-point rounding.

        Works on the whole model, unsharded or tensor-parallel by :func:`gpt_tp_plan` without
        sequence parallelism (the cache then holds this rank's heads). Logits are a ``DTensor``
        sharded over the vocabulary under a ``loss_parallel`` plan.

        Args:
            idx: New token ids ``(batch, t)``: the (left-padded) prompts, then one per step.
            cache: The sequences' :class:`~torsh_distributed.inference.cache.KVCache`, updated.

        Raises:
            ValueError: a pipeline stage (no embeddings or no head), a sequence-parallel
                model, or a position past ``block_size``.
        """
        if self.tok_emb is None or self.pos_emb is None or self.head is None or self.ln_f is None:
            raise ValueError("forward_cached needs the whole GPT, not a pipeline stage of it")
        if isinstance(self.ln_f.weight, DTensor):
            # only sequence parallelism makes the norms DTensors; it shards the sequence, which
            # one new token per step cannot be
            raise ValueError(
                "forward_cached does not support sequence parallelism: shard the model with "
                "gpt_tp_plan(sequence_parallel=False) for inference (same weights)"
            )
        step = cache.begin(idx.shape[1], max_positions=self.config.block_size)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(step.positions))
        for i, block in enumerate(self.blocks):
            x = block(x, cache.layer(i), step.mask)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (of a batch or a micro-batch)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
