"""The machinery behind :mod:`torsh_distributed.inference.server` (private): request parsing,
the queue that forms batches, decoding a batch with per-request failure isolation, the
tensor-parallel batch broadcast and the Prometheus metrics.

Nothing here unpickles anything: requests are JSON parsed into plain values and checked field
by field, and the batches rank 0 sends to the other tensor-parallel ranks travel as JSON bytes in
a ``uint8`` tensor.
"""

from __future__ import annotations

import json
import math
import queue
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
    "RequestError",
    "CompletionRequest",
    "parse_completion",
    "Pending",
    "answer",
    "BatchQueue",
    "decode_batch",
    "broadcast_json",
    "ServingMetrics",
]

FIELDS: dict[str, str] = {
    "prompt": "a non-empty string",
    "max_new_tokens": "an int >= 1",
    "temperature": "a number >= 0 (0 = greedy)",
    "top_k": "an int >= 0 (0 = off)",
    "top_p": "a number in (0, 1]",
    "seed": "an int in [0, 2**64)",
    "stop": "a list of non-empty strings",
    "stream": "true or false",
}
"""The fields of ``POST /v1/completions`` and what each must be."""

_SAMPLING_NAMES = {"sampling.stop_strings": "stop", "sampling.": ""}


class RequestError(ValueError):
    """A request the server refuses: its HTTP status and a message naming the field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(kw_only=True, slots=True)
class CompletionRequest:
    """One validated completion request."""

    prompt_tokens: list[int]
    """The encoded prompt."""
    sampling: SamplingConfig
    """Its sampling settings (``stop`` is ``stop_strings``)."""
    stream: bool
    """Answer as server-sent events, one per token, then a final one."""


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


def parse_completion(
    body: bytes,
    *,
    encode: Callable[[str], list[int]],
    max_seq_len: int | None,
    max_new_tokens_limit: int,
    max_total_tokens: int | None,
    default_max_new_tokens: int,
) -> CompletionRequest:
    """A :class:`CompletionRequest` from a request body, or :class:`RequestError` (400) whose
    message names the offending field.

    Checks, in order: UTF-8 JSON object, unknown fields, types, the prompt's length against the
    model's context, ``max_new_tokens`` against the server's limit, prompt plus
    ``max_new_tokens`` against ``max_total_tokens``, and the sampling values themselves.
    """
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise RequestError(
            400, f"unknown field(s): {', '.join(unknown)} (known: {', '.join(FIELDS)})"
        )
    if "prompt" not in data:
        raise RequestError(400, "missing field: prompt (a non-empty string)")
    checks: dict[str, Callable[[object], bool]] = {
        "prompt": lambda v: isinstance(v, str) and bool(v),
        "max_new_tokens": _is_int,
        "temperature": _is_number,
        "top_k": _is_int,
        "top_p": _is_number,
        "seed": _is_int,
        "stop": lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
        "stream": lambda v: isinstance(v, bool),
    }
    for name, value in data.items():
        if not checks[name](value):
            raise RequestError(400, f"{name} must be {FIELDS[name]}, got {json.dumps(value)[:80]}")
    tokens = encode(data["prompt"])
    if not tokens:
        raise RequestError(400, "prompt encodes to no tokens")
    if max_seq_len is not None and len(tokens) > max_seq_len:
        raise RequestError(
            400,
            f"prompt is {len(tokens)} tokens, longer than the model's context of {max_seq_len}",
        )
    new = data.get("max_new_tokens", default_max_new_tokens)
    if new > max_new_tokens_limit:
        raise RequestError(
            400, f"max_new_tokens must be <= {max_new_tokens_limit} (the server's limit), got {new}"
        )
    if max_total_tokens is not None and len(tokens) + new > max_total_tokens:
        raise RequestError(
            400,
            f"prompt ({len(tokens)} tokens) + max_new_tokens ({new}) is over the server's limit "
            f"of {max_total_tokens} tokens",
        )
    try:
        sampling = SamplingConfig(
            max_new_tokens=new,
            temperature=data.get("temperature", 1.0),
            top_k=data.get("top_k", 0),
            top_p=data.get("top_p", 1.0),
            seed=data.get("seed", 0),
            stop_strings=tuple(data.get("stop", ())),
        )
    except ValueError as exc:
        message = str(exc)
        for old, new_name in _SAMPLING_NAMES.items():
            message = message.replace(old, new_name)
        raise RequestError(400, message) from None
    return CompletionRequest(
        prompt_tokens=tokens, sampling=sampling, stream=bool(data.get("stream", False))
    )


@dataclass(kw_only=True, eq=False)
class Pending:
    """A request waiting for, or being decoded by, the model worker.

    The worker puts ``("token", id)`` events (streaming only), then exactly one
    ``("done", GenerationResult)`` or ``("error", (status, message))`` on :attr:`events`; the
    HTTP thread that owns the request reads them.
    """

    request: CompletionRequest
    arrived: float = field(default_factory=time.perf_counter)
    """When the request was accepted (``time.perf_counter``): latencies count the queue."""
    events: queue.SimpleQueue[tuple[str, Any]] = field(default_factory=queue.SimpleQueue)
    started: float | None = None
    """When its batch began decoding."""
    finished: float | None = None
    _sent: int = 0
    _attempt_pos: int = 0

    def begin_attempt(self) -> None:
        """A decode of this request starts (again, after a failed batch): tokens already
        streamed are not sent twice (a retry regenerates them identically)."""
        self._attempt_pos = 0
        if self.started is None:
            self.started = time.perf_counter()

    def token(self, token: int) -> None:
        self._attempt_pos += 1
        if self.request.stream and self._attempt_pos > self._sent:
            self._sent = self._attempt_pos
            self.events.put(("token", token))

    def done(self, result: GenerationResult) -> None:
        self.finished = time.perf_counter()
        self.events.put(("done", result))

    def fail(self, status: int, message: str) -> None:
        self.finished = time.perf_counter()
        self.events.put(("error", (status, message)))


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

    def put(self, item: Pending) -> bool:
        """Queue ``item``; ``False`` when the queue is full or closed."""
        with self._cond:
            if self._closed or len(self._items) >= self.max_size:
                return False
            self._items.append(item)
            self._cond.notify()
            return True

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


def answer(pending: Pending, result: GenerationResult) -> dict[str, Any]:
    """The JSON answer to a completed request."""
    assert pending.started is not None and pending.finished is not None
    queue_s = pending.started - pending.arrived
    return {
        "completion": result.text,
        "tokens": result.tokens,
        "stop_reason": result.stop_reason,
        "usage": {
            "prompt_tokens": len(result.prompt_tokens),
            "completion_tokens": len(result.tokens),
            "total_tokens": len(result.prompt_tokens) + len(result.tokens),
        },
        "timing": {
            "queue_s": queue_s,
            "ttft_s": queue_s + result.time_to_first_token_s,
            "total_s": pending.finished - pending.arrived,
        },
    }


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
