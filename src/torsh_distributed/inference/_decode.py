"""The decoding loop behind :mod:`torsh_distributed.inference.generate` (private).

One loop for both ways of computing the next logits: :class:`_CachedStep` (KV cache, left-padded
rows, finished rows masked) and :class:`_RecomputeStep` (the whole sequence each step, rows
right-padded: exact for a causal model, whose last real position does not see the padding).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from torsh_distributed.inference.cache import KVCache
from torsh_distributed.inference.sampling import SamplingConfig, make_rng, sample_token
from torsh_distributed.inference.text import cut_at_stop

StopReason = Literal["max_tokens", "stop_token", "stop_string", "max_length"]
Decode = Callable[[Sequence[int]], str]
OnToken = Callable[[int, int], None]
"""``on_token(row, token)``: called once per generated token, in order, as soon as it is chosen."""


@dataclass(kw_only=True, slots=True)
class _Row:
    """One sequence being generated."""

    prompt: list[int]
    config: SamplingConfig
    limit: int
    """Tokens it may generate: ``max_new_tokens``, or fewer to stay within the context."""
    limit_reason: StopReason
    rng: torch.Generator
    tokens: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    reason: StopReason | None = None

    def add(self, token: int, latency: float, decode: Decode | None) -> None:
        self.tokens.append(token)
        self.latencies.append(latency)
        if token in self.config.stop_tokens:
            self.reason = "stop_token"
        elif self.config.stop_strings and decode is not None:
            if cut_at_stop(decode(self.tokens), self.config.stop_strings)[1]:
                self.reason = "stop_string"
        if self.reason is None and len(self.tokens) >= self.limit:
            self.reason = self.limit_reason


def make_rows(
    prompts: Sequence[list[int]], configs: Sequence[SamplingConfig], max_seq_len: int | None
) -> list[_Row]:
    rows = []
    for prompt, config in zip(prompts, configs, strict=True):
        limit, reason = config.max_new_tokens, "max_tokens"
        if max_seq_len is not None and max_seq_len - len(prompt) + 1 < limit:
            # the last token is predicted at position max_seq_len - 1 and never fed back
            limit, reason = max_seq_len - len(prompt) + 1, "max_length"
        rows.append(
            _Row(
                prompt=prompt,
                config=config,
                limit=limit,
                limit_reason=reason,
                rng=make_rng(config.seed),
            )
        )
    return rows


def _full(output: object) -> torch.Tensor:
    """The logits of a forward's output: first element of a tuple, gathered if a DTensor."""
    from torch.distributed.tensor import DTensor

    logits = output[0] if isinstance(output, tuple) else output
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise TypeError(
            f"the model must return logits [batch, seq, vocab], got "
            f"{getattr(logits, 'shape', type(logits).__name__)}"
        )
    return logits


def model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


class _CachedStep:
    """Logits by incremental decoding: prefill the left-padded prompts, then one slot a step."""

    def __init__(self, model: nn.Module, rows: list[_Row], device: torch.device) -> None:
        self.model = model
        self.device = device
        width = max(len(r.prompt) for r in rows)
        pad = [width - len(r.prompt) for r in rows]
        # prefill + one slot per fed token; a row's last token is never fed
        self.cache = KVCache(
            batch_size=len(rows),
            max_len=width + max(r.limit for r in rows) - 1,
            left_pad=pad,
            device=device,
        )
        self.prompts = torch.tensor([[0] * p + r.prompt for p, r in zip(pad, rows, strict=True)])

    def first(self) -> torch.Tensor:
        return _full(self.model.forward_cached(self.prompts.to(self.device), self.cache))[:, -1]

    def next(self, rows: list[_Row]) -> torch.Tensor:
        self.cache.finish([i for i, r in enumerate(rows) if r.reason is not None])
        last = [[r.tokens[-1] if r.reason is None else 0] for r in rows]
        x = torch.tensor(last, device=self.device)
        return _full(self.model.forward_cached(x, self.cache))[:, -1]


class _RecomputeStep:
    """Logits by a full forward of every unfinished sequence, right-padded to the longest."""

    def __init__(self, model: nn.Module, rows: list[_Row], device: torch.device) -> None:
        self.model = model
        self.device = device
        self.rows = rows

    def _last_logits(self, rows: list[_Row]) -> torch.Tensor:
        active = [i for i, r in enumerate(rows) if r.reason is None]
        seqs = [rows[i].prompt + rows[i].tokens for i in active]
        width = max(len(s) for s in seqs)
        x = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=self.device)
        logits = _full(self.model(x))
        last = torch.tensor([len(s) - 1 for s in seqs], device=logits.device)
        picked = logits[torch.arange(len(seqs), device=logits.device), last]
        out = picked.new_zeros(len(rows), picked.shape[-1])
        out[torch.tensor(active, device=logits.device)] = picked
        return out

    def first(self) -> torch.Tensor:
        return self._last_logits(self.rows)

    def next(self, rows: list[_Row]) -> torch.Tensor:
        return self._last_logits(rows)


def _agree(tokens: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """The tokens of the tp group's first rank on every rank of it (see sampling's module doc)."""
    if group is None or dist.get_world_size(group) == 1:
        return tokens
    t = torch.tensor(tokens, dtype=torch.long, device=device)
    dist.broadcast(t, group_src=0, group=group)
    return [int(v) for v in t.tolist()]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout), each submodule's mode restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def run(
    model: nn.Module,
    rows: list[_Row],
    *,
    use_cache: bool,
    decode: Decode | None,
    group: dist.ProcessGroup | None,
    on_token: OnToken | None = None,
) -> None:
    """Generate every row to its stop; fills ``rows`` in place (``on_token`` sees each token
    of row ``i`` as it is added, e.g. to stream it)."""
    device = model_device(model)
    with torch.no_grad(), eval_mode(model):
        start = time.perf_counter()
        step = (
            _CachedStep(model, rows, device) if use_cache else _RecomputeStep(model, rows, device)
        )
        logits = step.first()
        while True:
            indices = [i for i, r in enumerate(rows) if r.reason is None]
            active = [rows[i] for i in indices]
            on_cpu = logits.detach().to("cpu", torch.float64)  # one transfer for the batch
            chosen = [
                sample_token(on_cpu[i], r.config, r.rng)
                for i, r in enumerate(rows)
                if r.reason is None
            ]
            chosen = _agree(chosen, group, logits.device)
            now = time.perf_counter()
            latency, start = now - start, now
            for row, token in zip(active, chosen, strict=True):
                row.add(token, latency, decode)
            if on_token is not None:
                for index, token in zip(indices, chosen, strict=True):
                    on_token(index, token)
            if all(r.reason is not None for r in rows):
                return
            logits = step.next(rows)
