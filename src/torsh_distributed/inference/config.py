"""The torch-free half of inference: :class:`SamplingConfig` and the weight dtypes a job may ask
for, so that ``torsh-dist generate/infer/serve --help`` and their refusals of bad flags need no
torch. The sampling itself is :mod:`~torsh_distributed.inference.sampling`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DTYPE_NAMES", "SamplingConfig"]

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
"""The ``dtype`` names a job accepts (``inference.jobs.DTYPES`` maps them to torch's dtypes)."""

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
