"""Continuous batching (private): iteration-level scheduling of rows over a
:class:`~torsh_distributed.inference._slots.SlotKVCache` (Orca's scheduling, vLLM's
continuous batching, without paging).

Each :meth:`ContinuousBatcher.step` is one iteration: rows the caller admits join (their prompts
prefilled in one forward, their first tokens sampled), every row already running advances by
one token (one decode forward), and rows that finished (or were cancelled) leave, freeing their
slot for the next iteration's arrivals. A row samples with its own seeded generator and sees only
its own slots, so its tokens are those :func:`~torsh_distributed.inference.generate.generate`
gives it alone (up to the rounding of differently shaped products, as for static batches).

The step is deterministic in its arguments, so under tensor parallelism every rank runs the same
steps: the serving rank decides the joins and cancellations, sends them, and all ranks call
:meth:`~ContinuousBatcher.step` with them (tokens are agreed by one broadcast per forward).

If a forward raises, its rows are retried one by one; a row that fails alone ends with its
exception and the others go on (a failure happens alike on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torsh_distributed.inference._decode import (
    _agree,
    _full,
    _Row,
    make_rows,
    model_device,
)
from torsh_distributed.inference._slots import SlotKVCache, Window
from torsh_distributed.inference.generate import TextGenerator, _result
from torsh_distributed.inference.protocol import CachedCausalLM, max_seq_len_of
from torsh_distributed.inference.sampling import SamplingConfig, sample_token

__all__ = ["Join", "Event", "ContinuousBatcher", "continuous_max_len"]

T = TypeVar("T")
Event = tuple[int, str, Any]
"""``(row id, "token", token)``, ``(row id, "done", GenerationResult)``,
``(row id, "error", exception)``, or, before a token event of a row that asked for them,
``(row id, "logprob", (logprob, [(token, logprob), ...]))``."""


@dataclass(frozen=True, slots=True)
class Join:
    """A row to admit: its id (chosen by the serving rank), prompt and sampling."""

    id: int
    prompt: list[int]
    sampling: SamplingConfig
    logprobs: int | None = None
    """Report each chosen token's log-probability and the ``logprobs`` most likely
    alternatives' (log-softmax of the model's logits, before temperature and filters);
    ``None`` = none."""

    def to_json(self) -> list[Any]:
        return [self.id, self.prompt, self.sampling.to_dict(), self.logprobs]

    @classmethod
    def from_json(cls, data: Sequence[Any]) -> Join:
        sampling = SamplingConfig.from_dict(data[2])
        return cls(id=int(data[0]), prompt=list(data[1]), sampling=sampling, logprobs=data[3])


@dataclass(slots=True)
class _Running:
    id: int
    row: _Row
    logprobs: int | None
    last: float
    """When its previous token was chosen (its prefill's start before the first)."""


def continuous_max_len(generator: TextGenerator, max_total_tokens: int | None) -> int | None:
    """Slots per row continuous batching needs for ``generator``'s model, or ``None`` when it
    cannot batch continuously (no ``forward_cached``, the cache switched off, or no length
    bound: neither a ``max_seq_len`` nor ``max_total_tokens``)."""
    if not isinstance(generator.model, CachedCausalLM) or generator.cache is False:
        return None
    limit = generator.max_seq_len or max_seq_len_of(generator.model)
    if limit is None:
        return max_total_tokens
    return limit if max_total_tokens is None else min(limit, max_total_tokens)


class ContinuousBatcher:
    """Runs rows of a :class:`TextGenerator` with iteration-level scheduling (module doc).

    Args:
        generator: Model, tokenizer, tensor-parallel group (``forward_cached`` required). The
            model is put in eval mode (no dropout) and left so.
        max_rows: Rows running at most (the slot cache's rows).
        max_len: Slots per row: the longest prompt plus completion (the model's context).
        max_batch_tokens: Tokens one iteration may feed (one per running row plus the prompts
            of the rows joining): a bound on each iteration's time, so that long prompts joining
            delay the running rows' next tokens by at most that much.
    """

    def __init__(
        self, generator: TextGenerator, *, max_rows: int, max_len: int, max_batch_tokens: int
    ) -> None:
        self.generator = generator
        self.model = generator.model
        # served models decode in eval mode for the engine's life (no dropout); switching modes
        # around every step would walk every module each step
        self.model.eval()
        self.device = model_device(generator.model)
        self.cache = SlotKVCache(max_rows=max_rows, max_len=max_len, device=self.device)
        self.max_rows = max_rows
        self.max_len = max_len
        self.max_batch_tokens = max_batch_tokens
        self.rows: list[_Running] = []
        self.limit = generator.max_seq_len or max_seq_len_of(generator.model)

    @property
    def running(self) -> int:
        return len(self.rows)

    def admits(self, prompt_len: int, *, joining: int, joining_tokens: int) -> bool:
        """Whether one more row with a prompt of ``prompt_len`` tokens fits this iteration,
        after ``joining`` rows with ``joining_tokens`` prompt tokens (the first row always
        fits an idle batch)."""
        if len(self.rows) + joining >= self.max_rows:
            return False
        tokens = len(self.rows) + joining_tokens + prompt_len
        return tokens <= self.max_batch_tokens or (not self.rows and not joining)

    def admission(self, size: Callable[[T], int]) -> Callable[[T], bool]:
        """A predicate admitting queued items (of prompt length ``size(item)``) one after
        another while they fit this iteration (:meth:`admits`, counting those admitted)."""
        taken = [0, 0]

        def fits(item: T) -> bool:
            n = size(item)
            if not self.admits(n, joining=taken[0], joining_tokens=taken[1]):
                return False
            taken[0] += 1
            taken[1] += n
            return True

        return fits

    def step(self, joins: Sequence[Join], cancel: Sequence[int] = ()) -> list[Event]:
        """One iteration (module doc); the events of its rows, in order."""
        events: list[Event] = []
        if cancel:
            gone = set(cancel)
            self._retire([i for i, r in enumerate(self.rows) if r.id in gone])
        with torch.no_grad():
            if self.rows:
                self._decode(events)
            if joins:
                self._prefill(joins, events)
        done = [i for i, r in enumerate(self.rows) if r.row.reason is not None]
        for i in done:
            r = self.rows[i].row
            result = _result(
                r.prompt, r.tokens, r.reason, r.latencies, r.config, self.generator.decode
            )
            events.append((self.rows[i].id, "done", result))
        self._retire(done)
        return events

    # -- the two forwards ------------------------------------------------------------------
    def _forward(self, window: Window, tokens: torch.Tensor) -> torch.Tensor:
        logits = _full(self.model.forward_cached(tokens.to(self.device), window))  # type: ignore[attr-defined]
        window.commit()
        return logits

    def _decode(self, events: list[Event]) -> None:
        count = len(self.rows)
        feed = torch.tensor([[r.row.tokens[-1]] for r in self.rows])
        try:
            logits = self._forward(self.cache.decode(0, count), feed)[:, -1]
        except Exception:  # noqa: BLE001 - find the row at fault: each alone
            self._one_by_one(
                range(count),
                lambda i: self._forward(self.cache.decode(i, i + 1), feed[i : i + 1])[0, -1],
                events,
            )
            return
        self._sample(range(count), logits, events)

    def _prefill(self, joins: Sequence[Join], events: list[Event]) -> None:
        start = len(self.rows)
        now = time.perf_counter()
        rows = make_rows([j.prompt for j in joins], [j.sampling for j in joins], self.limit)
        for join, row in zip(joins, rows, strict=True):
            self.rows.append(_Running(id=join.id, row=row, logprobs=join.logprobs, last=now))
        lengths = [len(j.prompt) for j in joins]
        width = max(lengths)
        feed = torch.tensor([j.prompt + [0] * (width - len(j.prompt)) for j in joins])
        last = torch.tensor(lengths) - 1
        try:
            out = self._forward(self.cache.prefill(start, lengths), feed)
            logits = out[torch.arange(len(joins)), last.to(out.device)]
        except Exception:  # noqa: BLE001
            self._one_by_one(
                range(start, start + len(joins)),
                lambda i: self._forward(
                    self.cache.prefill(i, [lengths[i - start]]),
                    feed[i - start : i - start + 1, : lengths[i - start]],
                )[0, -1],
                events,
            )
            return
        self._sample(range(start, start + len(joins)), logits, events)

    def _one_by_one(self, indices: range, forward: Any, events: list[Event]) -> None:
        ok: list[int] = []
        picked: list[torch.Tensor] = []
        for i in indices:
            try:
                picked.append(forward(i))
                ok.append(i)
            except Exception as exc:  # noqa: BLE001 - this row fails alone
                events.append((self.rows[i].id, "error", exc))
                self.rows[i].id = -1 - self.rows[i].id
        if ok:
            self._sample(ok, torch.stack(picked), events)
        self._retire([i for i in indices if self.rows[i].id < 0])

    def _sample(self, indices: Sequence[int], logits: torch.Tensor, events: list[Event]) -> None:
        on_cpu = logits.detach().to("cpu", torch.float64)
        chosen = [
            sample_token(on_cpu[k], self.rows[i].row.config, self.rows[i].row.rng)
            for k, i in enumerate(indices)
        ]
        group = self.generator.tp_group
        chosen = _agree(chosen, group if _multi(group) else None, logits.device)
        now = time.perf_counter()
        for k, (i, token) in enumerate(zip(indices, chosen, strict=True)):
            running = self.rows[i]
            running.row.add(token, now - running.last, self.generator.decode)
            running.last = now
            if running.logprobs is not None:
                events.append(
                    (running.id, "logprob", _logprobs(on_cpu[k], token, running.logprobs))
                )
            events.append((running.id, "token", token))

    def _retire(self, indices: Sequence[int]) -> None:
        """Drop rows (descending order keeps the indices valid), moving the last running row
        into each freed slot."""
        for i in sorted(indices, reverse=True):
            last = len(self.rows) - 1
            if i != last:
                self.cache.move(last, i)
                self.rows[i] = self.rows[last]
            self.rows.pop()


def _logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the ``top`` most likely tokens' (model logits)."""
    lp = torch.log_softmax(logits, dim=-1)
    best = torch.topk(lp, min(top, lp.numel())) if top else None
    alternatives = (
        [] if best is None else list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    )
    return float(lp[token]), alternatives


def _multi(group: dist.ProcessGroup | None) -> bool:
    return group is not None and dist.get_world_size(group) > 1
