"""How the next token is chosen: :class:`SamplingConfig` (defined, torch-free, in
:mod:`~torsh_distributed.inference.config`) and :func:`sample_token`.

Sampling is reproducible and independent of where it runs: the logits are taken to the CPU in
float64 and the one uniform number each sampled token needs comes from a CPU
:class:`torch.Generator` seeded by :attr:`SamplingConfig.seed` (one generator per sequence), so
the same logits and seed give the same tokens on any device, at any batch size and on every rank.

Under tensor parallelism every rank of the ``tp`` group holds the same full (gathered) logits
and samples with its own generator seeded alike: the ranks draw the same token with no
communication. :mod:`~torsh_distributed.inference.generate` then broadcasts the tokens of the
group's first rank anyway (a few bytes per step), so that the ranks cannot feed different tokens
to the model even if a reduction ever rounded differently on one of them.

The filters apply in the usual order: temperature, then top-k, then top-p (nucleus).
``temperature == 0`` is greedy decoding (the arg-max, the lowest token id among equal maxima);
it draws no random number and ignores ``top_k`` / ``top_p``, which cannot change the arg-max.
"""

from __future__ import annotations

import math

import torch

from torsh_distributed.inference.config import SamplingConfig

__all__ = ["SamplingConfig", "filter_logits", "make_rng", "sample_token"]


def make_rng(seed: int) -> torch.Generator:
    """The CPU generator a sequence samples with (see the module doc)."""
    return torch.Generator(device="cpu").manual_seed(seed)


def filter_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """``logits / temperature`` with every token outside the top-k / top-p support at ``-inf``.

    Args:
        logits: ``[..., vocab]``; computed in float64 on the CPU whatever their dtype/device.
        config: A config with ``temperature > 0``.

    Returns:
        Float64 CPU logits whose softmax is the sampling distribution.
    """
    if config.greedy:
        raise ValueError("filter_logits needs temperature > 0 (greedy decoding takes the arg-max)")
    scaled = logits.detach().to("cpu", torch.float64) / config.temperature
    vocab = scaled.shape[-1]
    if 0 < config.top_k < vocab:
        kth = torch.topk(scaled, config.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if config.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # keep a token while the mass of the more likely ones is still below top_p, so the
        # most likely token is always kept
        keep_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) < config.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        scaled = scaled.masked_fill(~keep, -math.inf)
    return scaled


def sample_token(logits: torch.Tensor, config: SamplingConfig, rng: torch.Generator) -> int:
    """One token from one row of logits ``[vocab]``.

    Greedy: the arg-max. Otherwise one uniform number ``u`` from ``rng`` picks the token by
    inverse CDF over the filtered distribution in token-id order, so each sampled token
    consumes exactly one draw whatever the logits (generators of ranks and batch rows stay in
    step).

    Raises:
        ValueError: ``logits`` is not 1-D or holds NaN.
    """
    if logits.dim() != 1:
        raise ValueError(f"sample_token takes one row of logits [vocab], got {tuple(logits.shape)}")
    row = logits.detach().to("cpu", torch.float64)
    if bool(torch.isnan(row).any()):
        raise ValueError("the model's logits contain NaN; cannot sample")
    if config.greedy:
        return int(row.argmax())
    probs = torch.softmax(filter_logits(row, config), dim=-1)
    u = torch.rand((), generator=rng, dtype=torch.float64)
    cdf = probs.cumsum(dim=0)
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if token >= probs.numel() or probs[token] == 0:
        # u * total rounded up to the total: the last token in the support
        token = int(probs.nonzero()[-1])
    return token
