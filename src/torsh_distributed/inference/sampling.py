"""How the next token is chosen: :class:`SamplingConfig` and :func:`sample_token`.

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

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SamplingConfig", "filter_logits", "make_rng", "sample_token"]

_MAX_SEED = 2**64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """How one sequence is continued: length, randomness and stop conditions."""

    max_new_tokens: int = 64
    """Tokens to generate at most (fewer when a stop condition or the context length ends the
    sequence first). Time and KV-cache memory grow linearly with it."""
    temperature: float = 1.0
    """Divides the logits before sampling: < 1 sharpens, > 1 flattens; 0 = greedy (arg-max,
    deterministic, no random number drawn)."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens only (all tokens whose logit ties with the
    k-th are kept); 0 = no limit."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches
    ``top_p`` (after temperature and top-k), in (0, 1]; 1 = no limit."""
    seed: int = 0
    """Seed of this sequence's random generator, in [0, 2**64): the same seed, prompt and model
    give the same tokens, alone or in any batch, at any tensor-parallel degree."""
    stop_tokens: tuple[int, ...] = ()
    """Token ids that end the sequence; the stop token is kept in ``tokens``, not in ``text``."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end the sequence once the decoded completion contains one (needs a
    ``decode`` function); ``text`` is cut before it, ``tokens`` keep what was generated."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (stop lists as lists)."""
        data = dataclasses.asdict(self)
        for name in ("stop_tokens", "stop_strings"):
            data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingConfig:
        """The config of :meth:`to_dict` output (validated again)."""
        data = dict(data)
        for name in ("stop_tokens", "stop_strings"):
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data)

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"sampling.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"
            )
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(
                f"sampling.temperature must be a finite number >= 0 (0 = greedy), got "
                f"{self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"sampling.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not 0.0 < self.top_p <= 1.0
        ):
            raise ValueError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < _MAX_SEED:
            raise ValueError(f"sampling.seed must be an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop_tokens, (str, bytes)) or isinstance(
            self.stop_strings, (str, bytes)
        ):
            raise ValueError(
                "sampling.stop_tokens and sampling.stop_strings must be sequences (a tuple), "
                "not a single string"
            )
        self.stop_tokens = tuple(self.stop_tokens)
        self.stop_strings = tuple(self.stop_strings)
        for token in self.stop_tokens:
            if not _is_int(token) or token < 0:
                raise ValueError(f"sampling.stop_tokens must be token ids >= 0, got {token!r}")
        for text in self.stop_strings:
            if not isinstance(text, str) or not text:
                raise ValueError(f"sampling.stop_strings must be non-empty strings, got {text!r}")

    @property
    def greedy(self) -> bool:
        """Whether tokens are the arg-max (``temperature == 0``)."""
        return self.temperature == 0


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
