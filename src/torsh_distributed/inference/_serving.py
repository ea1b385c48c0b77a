"""The machinery behind :mod:`torsh_distributed.inference.server` (private): the rows waiting
for the model worker and the queue that forms batches, decoding a batch with per-request failure isolation, the
tensor-parallel batch broadcast and the Prometheus metrics.

Nothing here unpickles anything: the batches rank 0 sends to the other tensor-parallel ranks travel as JSON bytes in
a ``uint8`` tensor.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.inference.generate import GenerationResult, TextGenerator, generate_batch
from torsh_distributed.inference.sampling import SamplingConfig

__all__ = [
    "Sink",
    "Pending",
    "BatchQueue",
    "decode_batch",
    "broadcast_json",
    "ServingMetrics",
]


class Sink:
    """Where the model worker sends one HTTP request's events: an ``asyncio`` queue on the
    server's event loop, fed thread-safely from the worker thread. Events are
    ``("token", choice, token_id)``, ``("done", choice, GenerationResult)`` and
    ``("error", choice, (status, message))``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()

    def put(self, event: tuple[str, int, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass(kw_only=True, eq=False)
class Pending:
    """One row (a choice of a request) waiting for, or being decoded by, the model worker.

    The worker sends ``("token", choice, id)`` events (streaming only), then exactly one
    ``("done", choice, GenerationResult)`` or ``("error", choice, (status, message))`` to
    :attr:`sink`, which the request's handler reads.
    """

    prompt_tokens: list[int]
    sampling: SamplingConfig
    stream: bool
    choice: int
    """Its index among the request's choices."""
    sink: Sink
    arrived: float = field(default_factory=time.perf_counter)
    """When the request was accepted (``time.perf_counter``): latencies count the queue."""
    started: float | None = None
    """When its decoding began."""
    finished: float | None = None
    cancelled: bool = False
    """Set by the handler when its client went away: a continuous batch drops the row."""
    logprobs: int | None = None
    """Alternatives per token whose log-probabilities are reported (``None``: none)."""
    logprob_values: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    """Per generated token: its log-probability and the top alternatives'."""
    _sent: int = 0
    _attempt_pos: int = 0

    def begin_attempt(self) -> None:
        """A decode of this row starts (again, after a failed batch): tokens already
        streamed are not sent twice (a retry regenerates them identically)."""
        self._attempt_pos = 0
        if self.started is None:
            self.started = time.perf_counter()

    def token(self, token: int) -> None:
        self._attempt_pos += 1
        if self.stream and self._attempt_pos > self._sent:
            self._sent = self._attempt_pos
            self.sink.put(("token", self.choice, token))

    def logprob(self, value: tuple[float, list[tuple[int, float]]]) -> None:
        self.logprob_values.append(value)
        if self.stream:
            self.sink.put(("logprob", self.choice, value))

    def done(self, result: GenerationResult) -> None:
        self.finished = time.perf_counter()
        self.sink.put(("done", self.choice, result))

    def fail(self, status: int, message: str) -> None:
        self.finished = time.perf_counter()
        self.sink.put(("error", self.choice, (status, message)))


class BatchQueue:
    """Requests waiting for the model worker, taken in arrival order in batches.

    Args:
        max_size: Requests queued at most; :meth:`put` refuses more (the server answers 503)
            instead of letting latency grow without bound.
    """

    def __init__(self, *, max_size: int) -> None:
        self._items: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.max_size = max_size

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, items: Sequence[Pending]) -> bool:
        """Queue all of ``items`` (one request's rows) or none: ``False`` when they do not fit
        or the queue is closed."""
        with self._cond:
            if self._closed or len(self._items) + len(items) > self.max_size:
                return False
            self._items.extend(items)
            self._cond.notify()
            return True

    def take(self, *, fits: Callable[[Pending], bool], wait_s: float) -> list[Pending] | None:
        """The queued rows, in arrival order, while ``fits(row)`` (called once per row taken,
        so it can count), waiting up to ``wait_s`` for a first one.

        Returns:
            The rows (maybe ``[]``); ``None`` once closed and empty.
        """
        with self._cond:
            if wait_s > 0:
                self._cond.wait_for(lambda: self._items or self._closed, timeout=wait_s)
            if self._closed and not self._items:
                return None
            out = []
            while self._items and fits(self._items[0]):
                out.append(self._items.popleft())
            return out

    def next_batch(
        self, *, max_batch_size: int, wait_s: float, idle_s: float
    ) -> list[Pending] | None:
        """Up to ``max_batch_size`` requests: waits up to ``idle_s`` for a first one, then up
        to ``wait_s`` more for others to join it (returning early when the batch is full).

        Returns:
            The batch; ``[]`` when nothing came within ``idle_s``; ``None`` once closed.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self._closed, timeout=idle_s):
                return []
            if self._closed:
                return None
            deadline = time.monotonic() + wait_s
            while len(self._items) < max_batch_size and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            return [self._items.popleft() for _ in range(min(max_batch_size, len(self._items)))]

    def close(self) -> list[Pending]:
        """Refuse new requests and return those still queued (the caller answers them)."""
        with self._cond:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return left


def decode_batch(
    generator: TextGenerator,
    prompts: Sequence[list[int]],
    configs: Sequence[SamplingConfig],
    *,
    on_token: Callable[[int, int], None] | None = None,
    on_attempt: Callable[[Sequence[int]], None] | None = None,
) -> list[GenerationResult | Exception]:
    """Decode ``prompts`` as one batch; if that raises, decode each alone so that one failing
    request does not fail the others (each gets its result or its own exception).

    Deterministic: every tensor-parallel rank that calls it with the same arguments runs the
    same sequence of batches (a failure that happens on every rank alike is retried alike).

    Args:
        generator: Model, tokenizer and tensor-parallel group.
        prompts: Token ids per request.
        configs: Sampling per request.
        on_token: ``on_token(i, token)`` for request ``i``'s tokens as they come.
        on_attempt: Called with the request indices of each decode attempt before it starts.
    """

    def attempt(indices: list[int]) -> list[GenerationResult]:
        if on_attempt is not None:
            on_attempt(indices)
        callback = None
        if on_token is not None:
            callback = lambda i, t: on_token(indices[i], t)  # noqa: E731
        return generate_batch(
            generator.model,
            [prompts[i] for i in indices],
            [configs[i] for i in indices],
            cache=generator.cache,
            decode=generator.decode,
            tp_group=generator.tp_group,
            max_seq_len=generator.max_seq_len,
            on_token=callback,
        )

    everyone = list(range(len(prompts)))
    try:
        return list(attempt(everyone))
    except Exception as exc:  # noqa: BLE001 - isolate the request that fails
        if len(prompts) == 1:
            return [exc]
    out: list[GenerationResult | Exception] = []
    for i in everyone:
        try:
            out.append(attempt([i])[0])
        except Exception as exc:  # noqa: BLE001
            out.append(exc)
    return out


def broadcast_json(obj: Any, group: dist.ProcessGroup) -> Any:
    """``obj`` (plain JSON data) from the group's first rank to every rank of ``group``.

    Sent as its JSON text in a ``uint8`` tensor (length first), so receiving ranks parse JSON
    and never unpickle. Pass ``None`` on the receiving ranks; every rank returns the object.
    """
    first = dist.get_rank(group) == 0
    payload = json.dumps(obj).encode() if first else b""
    size = torch.tensor([len(payload)], dtype=torch.long)
    dist.broadcast(size, group_src=0, group=group)
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if first
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(data, group_src=0, group=group)
    return obj if first else json.loads(bytes(data.tolist()).decode())


class ServingMetrics:
    """Counters and histograms of the server, in a private Prometheus registry (the
    convention of :class:`~torsh_distributed.monitor.prometheus.PrometheusExporter`): served
    as text on the server's own ``/metrics``, behind the same token as every other route.

    Without ``prometheus_client`` (the ``monitor`` extra) it records nothing and
    :meth:`text` returns ``None``.
    """

    def __init__(self) -> None:
        from torsh_distributed.monitor.prometheus import available

        self.enabled = available()
        if not self.enabled:
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "torsh_serve_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "code"],
            registry=r,
        )
        self.batch_size = Histogram(
            "torsh_serve_batch_size",
            "Requests decoded together per batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.latency = Histogram(
            "torsh_serve_request_latency_seconds",
            "Completion latency from arrival to the last token (queueing included).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.ttft = Histogram(
            "torsh_serve_time_to_first_token_seconds",
            "Time from arrival to the first generated token (queueing included).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.tokens = Counter("torsh_serve_generated_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter(
            "torsh_serve_prompt_tokens", "Prompt tokens of completed requests.", registry=r
        )
        self.queue_depth = Gauge(
            "torsh_serve_queue_depth", "Requests waiting for the model worker.", registry=r
        )

    def request(self, route: str, code: int) -> None:
        if self.enabled:
            self.requests.labels(route, str(code)).inc()

    def batch(self, size: int, queued: int) -> None:
        if self.enabled:
            self.batch_size.observe(size)
            self.queue_depth.set(queued)

    def completion(self, result: GenerationResult, *, ttft_s: float, total_s: float) -> None:
        if self.enabled:
            self.latency.observe(total_s)
            self.ttft.observe(ttft_s)
            self.tokens.inc(len(result.tokens))
            self.prompt_tokens.inc(len(result.prompt_tokens))

    def text(self) -> str | None:
        """The exposition text a scrape returns; ``None`` without ``prometheus_client``."""
        if not self.enabled:
            return None
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
