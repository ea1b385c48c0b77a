"""Generation: :func:`generate` (one prompt), :func:`generate_batch` (prompts decoded together)
and :class:`TextGenerator` (text in, completions out: what a server or batch inference holds).

**How.** With a KV cache (a model with ``forward_cached``, :mod:`~torsh_distributed.inference.protocol`)
the prompts are left-padded to the longest and prefilled in one forward, then each step feeds one
token per row; rows that finished are masked and stop advancing, so each row is computed as if
alone. Without (any causal ``tokens -> logits`` model) every step runs the whole sequences,
right-padded: exact, ``O(n^2)``. Either way a batch is ``B`` sequences decoded together and each
row samples with its own seeded generator, so **batching does not change a row's tokens** (up to
floating-point rounding of differently-shaped matrix products, which can flip a greedy choice only
between logits that tie to within that rounding).

**Tensor parallelism.** Every rank of the ``tp`` group runs the same call (same prompts, same
configs): the model's collectives need all of them. Each rank holds the full logits (gathered by
the head, or from a vocabulary-sharded ``DTensor``), samples like the others, and takes the
tokens of the group's first rank (one broadcast of ``B`` ids per step), so all ranks return the
same results. Under TP the KV cache holds only the rank's heads.

**Stops.** A row ends at ``max_new_tokens`` (``"max_tokens"``), at a stop token
(``"stop_token"``), when the decoded completion contains a stop string (``"stop_string"``) or
when its next token would be fed past the model's ``max_seq_len`` (``"max_length"``; the
prompt plus completion then holds ``max_seq_len + 1`` tokens, the last predicted from a full
window).

**Timing.** ``token_latencies_s[0]`` is the time to first token (prefill and first sample);
each later entry the time of its decode step (shared by the rows of a batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.inference._decode import OnToken, StopReason, make_rows, run
from torsh_distributed.inference.protocol import CachedCausalLM, max_seq_len_of
from torsh_distributed.inference.sampling import SamplingConfig
from torsh_distributed.inference.text import cut_at_stop, decode_bytes, encode_bytes

__all__ = [
    "GenerationResult",
    "StopReason",
    "TextGenerator",
    "find_tp_group",
    "generate",
    "generate_batch",
]

TPGroup = dist.ProcessGroup | None | Literal["auto"]


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    """One generated sequence."""

    prompt_tokens: list[int]
    """The prompt's token ids."""
    tokens: list[int]
    """The generated token ids (a stop token included; the prompt not)."""
    text: str | None
    """The decoded completion without a final stop token and cut before a stop string;
    ``None`` when no ``decode`` function was given."""
    stop_reason: StopReason
    """Why it ended: ``max_tokens``, ``stop_token``, ``stop_string`` or ``max_length``."""
    token_latencies_s: list[float]
    """Seconds each generated token took; the first is the time to first token."""

    @property
    def time_to_first_token_s(self) -> float:
        """Prefill plus the first sample, in seconds."""
        return self.token_latencies_s[0]

    @property
    def time_per_output_token_s(self) -> float | None:
        """Mean seconds per token after the first; ``None`` with a single token."""
        rest = self.token_latencies_s[1:]
        return sum(rest) / len(rest) if rest else None

    @property
    def total_time_s(self) -> float:
        return sum(self.token_latencies_s)


def find_tp_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group of the 1-D mesh of ``model``'s ``DTensor`` parameters (a
    tensor-parallel model), or ``None`` when it has none.

    Raises:
        ValueError: the parameters live on a mesh that is not 1-D (pass the group yourself).
    """
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            if mesh.ndim != 1:
                raise ValueError(
                    f"the model's DTensor parameters live on a {mesh.ndim}-D mesh; pass "
                    f"tp_group= explicitly"
                )
            return mesh.get_group()
    return None


def _prompt(tokens: Sequence[int] | torch.Tensor, index: int, max_seq_len: int | None) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(
                f"prompt {index} must be 1-D token ids, got shape {tuple(tokens.shape)}"
            )
        tokens = tokens.tolist()
    out = [int(t) for t in tokens]
    if not out:
        raise ValueError(f"prompt {index} is empty: generation needs at least one token")
    if min(out) < 0:
        raise ValueError(f"prompt {index} holds a negative token id {min(out)}")
    if max_seq_len is not None and len(out) > max_seq_len:
        raise ValueError(
            f"prompt {index} has {len(out)} tokens, more than the model's max_seq_len {max_seq_len}"
        )
    return out


def generate_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    config: SamplingConfig | Sequence[SamplingConfig],
    *,
    cache: bool | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    tp_group: TPGroup = "auto",
    max_seq_len: int | None = None,
    on_token: OnToken | None = None,
) -> list[GenerationResult]:
    """Continue every prompt, decoding them together (see the module doc).

    Args:
        model: A :class:`~torsh_distributed.inference.protocol.CausalLM`, unsharded or
            tensor-parallel (not FSDP/DDP-wrapped). Run in eval mode under ``no_grad``; its
            modes are restored afterwards.
        prompts: Token ids per prompt, of any lengths (each at least one token).
        config: One :class:`SamplingConfig` for all, or one per prompt (each row samples with
            its own generator seeded by its config's ``seed``).
        cache: ``True``: decode with a KV cache (the model must have ``forward_cached``);
            ``False``: recompute the whole sequence each step (any model; ``O(n^2)``);
            ``None``: the cache when the model has one.
        decode: ``tokens -> str``, to fill ``text`` and to check ``stop_strings``.
        tp_group: The tensor-parallel group whose ranks must agree on the tokens; ``"auto"``
            finds it from the model's ``DTensor`` parameters (:func:`find_tp_group`); ``None``
            = no agreement step.
        max_seq_len: The model's context length; default its ``max_seq_len`` attribute, if any.
        on_token: ``on_token(i, token)`` is called for each token of prompt ``i`` as soon as
            it is chosen (before the next decode step), to stream it; ``None`` = no callback.
            It runs on the decoding thread: a slow callback slows every row of the batch.

    Returns:
        One :class:`GenerationResult` per prompt, in order.

    Raises:
        ValueError: an empty prompt list or prompt, a prompt longer than ``max_seq_len``, a
            config list of the wrong length, stop strings without ``decode``.
        TypeError: ``cache=True`` for a model without ``forward_cached``.
    """
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    configs = [config] * len(prompts) if isinstance(config, SamplingConfig) else list(config)
    if len(configs) != len(prompts):
        raise ValueError(f"got {len(configs)} sampling configs for {len(prompts)} prompts")
    if decode is None and any(c.stop_strings for c in configs):
        raise ValueError("sampling.stop_strings needs a decode function (decode=)")
    has_cache = isinstance(model, CachedCausalLM)
    if cache and not has_cache:
        raise TypeError(
            f"{type(model).__name__} has no forward_cached(tokens, cache) (see "
            f"inference.protocol.CachedCausalLM); pass cache=False to recompute each step"
        )
    limit = max_seq_len if max_seq_len is not None else max_seq_len_of(model)
    if limit is not None and limit < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {limit}")
    rows = make_rows([_prompt(p, i, limit) for i, p in enumerate(prompts)], configs, limit)
    group = find_tp_group(model) if tp_group == "auto" else tp_group
    run(
        model,
        rows,
        use_cache=has_cache if cache is None else cache,
        decode=decode,
        group=group,
        on_token=on_token,
    )
    return [
        _result(row.prompt, row.tokens, row.reason, row.latencies, row.config, decode)
        for row in rows
    ]


def _result(
    prompt: list[int],
    tokens: list[int],
    reason: StopReason | None,
    latencies: list[float],
    config: SamplingConfig,
    decode: Callable[[Sequence[int]], str] | None,
) -> GenerationResult:
    assert reason is not None, "a row ended without a stop reason"
    text = None
    if decode is not None:
        body = tokens[:-1] if reason == "stop_token" else tokens
        text = cut_at_stop(decode(body), config.stop_strings)[0]
    return GenerationResult(
        prompt_tokens=prompt,
        tokens=list(tokens),
        text=text,
        stop_reason=reason,
        token_latencies_s=list(latencies),
    )


def generate(
    model: nn.Module,
    prompt_tokens: Sequence[int] | torch.Tensor,
    config: SamplingConfig,
    *,
    cache: bool | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    tp_group: TPGroup = "auto",
    max_seq_len: int | None = None,
) -> GenerationResult:
    """Continue one prompt: :func:`generate_batch` with a batch of one (same arguments)."""
    return generate_batch(
        model,
        [prompt_tokens],
        config,
        cache=cache,
        decode=decode,
        tp_group=tp_group,
        max_seq_len=max_seq_len,
    )[0]


class TextGenerator:
    """A model with its tokenizer: text prompts in, :class:`GenerationResult` s out.

    What a server (a batch of requests per call) or batch inference holds. Under tensor
    parallelism every rank of the ``tp`` group must call :meth:`generate` with the same prompts
    and configs (e.g. rank 0 receives requests and broadcasts them); all return the same
    results.

    Args:
        model: See :func:`generate_batch`.
        encode: ``str -> token ids``; default UTF-8 bytes (the built-in GPT's tokenizer).
        decode: ``token ids -> str``; default UTF-8 bytes, invalid sequences replaced.
        cache: See :func:`generate_batch`.
        tp_group: See :func:`generate_batch`; resolved once, here.
        max_seq_len: See :func:`generate_batch`.
        max_batch_size: Prompts decoded together at most; more are split into batches in order.
            A larger batch amortises each step's weight reads and collectives over more rows,
            at the cost of KV-cache memory (``batch x longest sequence``) and of every row
            waiting for the slowest.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        encode: Callable[[str], list[int]] = encode_bytes,
        decode: Callable[[Sequence[int]], str] = decode_bytes,
        cache: bool | None = None,
        tp_group: TPGroup = "auto",
        max_seq_len: int | None = None,
        max_batch_size: int = 16,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.encode = encode
        self.decode = decode
        self.cache = cache
        self.tp_group = find_tp_group(model) if tp_group == "auto" else tp_group
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size

    def generate(
        self,
        prompts: Sequence[str],
        sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
    ) -> list[GenerationResult]:
        """Complete each prompt (``sampling``: one config for all, one per prompt, or the
        defaults of :class:`SamplingConfig`)."""
        return self.generate_tokens([self.encode(p) for p in prompts], sampling)

    def generate_tokens(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
    ) -> list[GenerationResult]:
        """:meth:`generate` from token ids."""
        if isinstance(sampling, SamplingConfig) or sampling is None:
            configs = [sampling or SamplingConfig()] * len(prompts)
        else:
            configs = list(sampling)
        if len(configs) != len(prompts):
            raise ValueError(f"got {len(configs)} sampling configs for {len(prompts)} prompts")
        out: list[GenerationResult] = []
        for start in range(0, len(prompts), self.max_batch_size):
            end = start + self.max_batch_size
            out += generate_batch(
                self.model,
                prompts[start:end],
                configs[start:end],
                cache=self.cache,
                decode=self.decode,
                tp_group=self.tp_group,
                max_seq_len=self.max_seq_len,
            )
        return out
