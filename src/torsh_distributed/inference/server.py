"""An HTTP completion server: requests that arrive together are decoded as one batch.

``POST /v1/completions`` takes ``{"prompt": ..., "max_new_tokens": ..., "temperature": ...,
"top_k": ..., "top_p": ..., "seed": ..., "stop": [...], "stream": ...}`` (only ``prompt``
required) and answers ``{"completion", "tokens", "stop_reason", "usage", "timing"}``, or with
``"stream": true`` server-sent events: one ``token`` event per token, then one ``done`` event
holding the whole answer. ``GET /health`` says whether the model worker is up (and, to an
authorised caller, what model it serves); ``GET /metrics`` is the Prometheus text. Errors are
``{"error": message}`` with a 4xx/5xx status; the message names the field at fault.

**Batching.** HTTP threads parse and validate each request, then queue it. One model worker
thread takes up to ``max_batch_size`` queued requests (after the first arrives it waits up to
``batch_wait_ms`` for others to join), decodes them as one batch with per-row sampling settings
(:func:`~torsh_distributed.inference.generate.generate_batch`), and answers each. A batch ends
when its longest row ends (static batching; continuous batching is not built). Batching does not
change a row's tokens (see :mod:`~torsh_distributed.inference.generate`). If a batch fails, each
of its requests is decoded alone, so a request that breaks generation gets a 500 and the others
their completions.

**Tensor parallelism.** On a tp group of N ranks only the group's first rank serves HTTP. Before
each batch it sends the batch (token ids and sampling settings, as JSON bytes in a tensor) to
the other ranks, which run :func:`follow`; all decode together. An idle server sends a heartbeat
every few seconds so that the others' waits never reach the process group's timeout, and a
``stop`` message when it closes.

**Security.** Binds ``127.0.0.1`` by default. Any other address requires a token
(:class:`ServerConfig` refuses to start without one); with a token every route but ``/health``
needs ``Authorization: Bearer <token>`` (compared in constant time), and ``/health`` tells an
unauthorised caller only whether the server is up. Request bodies are size-limited and parsed as
JSON; nothing a client sends is unpickled or evaluated. There is no TLS: put a TLS-terminating
proxy in front of a server reachable beyond the host.
"""

from __future__ import annotations

import hmac
import ipaddress
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from torsh_distributed.inference._http import InFlight, bind
from torsh_distributed.inference._serving import (
    BatchQueue,
    Pending,
    RequestError,
    ServingMetrics,
    answer,
    broadcast_json,
    decode_batch,
    parse_completion,
)
from torsh_distributed.inference.generate import GenerationResult, TextGenerator
from torsh_distributed.inference.protocol import max_seq_len_of
from torsh_distributed.inference.sampling import SamplingConfig

__all__ = ["ServerConfig", "InferenceServer", "follow", "is_loopback", "MIN_TOKEN_LENGTH"]

MIN_TOKEN_LENGTH = 16
HEARTBEAT_S = 5.0
"""Seconds between the idle messages rank 0 sends the other tensor-parallel ranks."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _positive(name: str, value: object, *, kind: type = int, zero: bool = False) -> None:
    ok = isinstance(value, kind) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < 0 or (value == 0 and not zero):  # type: ignore[operator]
        bound = ">= 0" if zero else "> 0"
        raise ValueError(
            f"server.{name} must be {'an int' if kind is int else 'a number'} "
            f"{bound}, got {value!r}"
        )


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Where the server listens, who may call it, and how it batches."""

    host: str = "127.0.0.1"
    """Bind address. Loopback by default; any other address (``0.0.0.0``, a LAN address)
    requires :attr:`token`, since then other machines can send requests."""
    port: int = 0
    """TCP port; 0 = a free port chosen by the OS (see :attr:`InferenceServer.port`)."""
    token: str | None = field(default=None, repr=False)
    """Shared secret: every request but ``/health`` must send ``Authorization: Bearer
    <token>``. At least 16 characters (``python -c 'import secrets;
    print(secrets.token_urlsafe(32))'``). ``None`` = no authentication (loopback only)."""
    max_batch_size: int = 8
    """Requests decoded together at most. Larger batches raise throughput (each step's weight
    reads are shared) at the cost of KV-cache memory and of every row waiting for the longest."""
    batch_wait_ms: float = 5.0
    """After a request arrives, how long the worker waits for others to join its batch: higher
    batches more under light load at the cost of that much added latency; 0 = take what is
    queued."""
    max_new_tokens_limit: int = 256
    """The largest ``max_new_tokens`` a request may ask for (400 above it)."""
    max_total_tokens: int | None = None
    """Prompt plus ``max_new_tokens`` at most (400 above it); ``None`` = no limit beyond the
    model's context, where generation stops with ``stop_reason == "max_length"``."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (413 above it)."""
    max_queued_requests: int = 256
    """Requests waiting at most; more are refused with 503 rather than queued without bound."""
    request_timeout_s: float = 600.0
    """A request not answered within this many seconds gets 504."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"server.host must be a host name or address, got {self.host!r}")
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port <= 65535
        ):
            raise ValueError(f"server.port must be an int in [0, 65535], got {self.port!r}")
        if self.token is not None:
            if not isinstance(self.token, str) or len(self.token) < MIN_TOKEN_LENGTH:
                raise ValueError(
                    f"server.token must be a string of at least {MIN_TOKEN_LENGTH} characters "
                    "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                )
            if any(c.isspace() or not c.isprintable() for c in self.token):
                raise ValueError("server.token must not contain whitespace or control characters")
        elif not is_loopback(self.host):
            raise ValueError(
                f"server.host {self.host!r} is not a loopback address: other machines could send "
                "requests, so a token is required (--token-env VAR or --token-file FILE); bind "
                "127.0.0.1 to serve this machine only"
            )
        for name in (
            "max_batch_size",
            "max_new_tokens_limit",
            "max_body_bytes",
            "max_queued_requests",
        ):
            _positive(name, getattr(self, name))
        if self.max_total_tokens is not None:
            _positive("max_total_tokens", self.max_total_tokens)
        _positive("batch_wait_ms", self.batch_wait_ms, kind=float, zero=True)
        _positive("request_timeout_s", self.request_timeout_s, kind=float)


class InferenceServer:
    """Serves :class:`TextGenerator` completions over HTTP until :meth:`close` (see the module
    doc). Starts listening and its model worker at construction.

    Args:
        generator: The model and tokenizer. Under tensor parallelism (its ``tp_group`` has more
            than one rank) this is the group's first rank, and every other rank runs
            :func:`follow` with its own generator.
        config: Address, token, batching and limits.
        model_info: What ``/health`` reports about the model to authorised callers (JSON data).

    Raises:
        OSError: the address cannot be bound (the message names it).
    """

    def __init__(
        self,
        generator: TextGenerator,
        config: ServerConfig,
        *,
        model_info: dict[str, Any] | None = None,
    ) -> None:
        self.generator = generator
        self.config = config
        self.model_info = dict(model_info or {})
        self.metrics = ServingMetrics()
        self.max_seq_len = (
            generator.max_seq_len
            if generator.max_seq_len is not None
            else max_seq_len_of(generator.model)
        )
        group = generator.tp_group
        self._group = group if group is not None and dist.get_world_size(group) > 1 else None
        self._queue = BatchQueue(max_size=config.max_queued_requests)
        self._closing = threading.Event()
        self._failure: BaseException | None = None
        self._current: list[Pending] = []
        self._handlers = InFlight()
        self._httpd = bind(self, self._handlers)
        self.host, self.port = self._httpd.server_address[:2]
        self._worker = threading.Thread(target=self._work, name="torsh-serve-model", daemon=True)
        self._worker.start()
        self._http = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="torsh-serve-http",
            daemon=True,
        )
        self._http.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    @property
    def healthy(self) -> bool:
        """The model worker is running and the server is not closing."""
        return self._worker.is_alive() and not self._closing.is_set()

    @property
    def failure(self) -> BaseException | None:
        """What stopped the model worker, if it died (e.g. a tensor-parallel peer vanished)."""
        return self._failure

    def __enter__(self) -> InferenceServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, timeout: float = 60.0) -> None:
        """Stop: refuse new connections, answer queued requests with 503, let the batch being
        decoded finish and be answered, release the other tensor-parallel ranks, free the port.
        Safe to call twice."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._httpd.shutdown()
        for pending in self._queue.close():
            pending.fail(503, "the server is shutting down")
        self._worker.join(timeout=timeout)
        self._handlers.wait_idle(timeout=5.0)  # let handlers write the last answers
        self._httpd.server_close()
        self._http.join(timeout=5.0)

    # -- model worker ---------------------------------------------------------------------
    def _work(self) -> None:
        c = self.config
        try:
            while True:
                batch = self._queue.next_batch(
                    max_batch_size=c.max_batch_size,
                    wait_s=c.batch_wait_ms / 1000.0,
                    idle_s=HEARTBEAT_S,
                )
                if batch is None:
                    break
                if not batch:
                    if self._group is not None:
                        broadcast_json({"kind": "idle"}, self._group)
                    continue
                self._decode(batch)
        except BaseException as exc:  # noqa: BLE001 - a broken tp group ends the worker
            self._failure = exc
            print(
                f"torsh-dist serve: the model worker stopped: {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            for pending in [*self._current, *self._queue.close()]:
                if pending.finished is None:
                    pending.fail(503, "the model worker stopped")
            return
        if self._group is not None:
            broadcast_json({"kind": "stop"}, self._group)

    def _decode(self, batch: list[Pending]) -> None:
        self._current = batch
        self.metrics.batch(len(batch), len(self._queue))
        prompts = [p.request.prompt_tokens for p in batch]
        configs = [p.request.sampling for p in batch]
        if self._group is not None:
            broadcast_json(
                {
                    "kind": "batch",
                    "prompts": prompts,
                    "sampling": [s.to_dict() for s in configs],
                },
                self._group,
            )

        def on_attempt(indices: Any) -> None:
            for i in indices:
                batch[i].begin_attempt()

        results = decode_batch(
            self.generator,
            prompts,
            configs,
            on_token=lambda i, t: batch[i].token(t),
            on_attempt=on_attempt,
        )
        for pending, result in zip(batch, results, strict=True):
            if isinstance(result, GenerationResult):
                pending.done(result)
                timing = answer(pending, result)["timing"]
                self.metrics.completion(result, ttft_s=timing["ttft_s"], total_s=timing["total_s"])
            else:
                print(
                    "torsh-dist serve: generation failed:\n"
                    + "".join(
                        traceback.format_exception(type(result), result, result.__traceback__)
                    ),
                    file=sys.stderr,
                    flush=True,
                )
                pending.fail(
                    500, f"generation failed: {type(result).__name__} (see the server log)"
                )

    # -- HTTP side (called by the handler threads) --------------------------------------------
    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value grants access (always, without a token)."""
        if self.config.token is None:
            return True
        scheme, _, value = (header or "").partition(" ")
        # compare_digest on bytes of any length: the time does not depend on the content
        return scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode(), self.config.token.encode()
        )

    def health(self, authorized: bool) -> tuple[int, dict[str, Any]]:
        """``/health``'s status and body; model details only for an authorised caller."""
        if self.healthy:
            status, body = 200, {"status": "ok"}
        else:
            status, body = 503, {"status": "failed" if self._failure else "stopping"}
        if authorized:
            tp = 1 if self._group is None else dist.get_world_size(self._group)
            body.update(
                model=self.model_info,
                tp=tp,
                max_seq_len=self.max_seq_len,
                max_batch_size=self.config.max_batch_size,
                max_new_tokens_limit=self.config.max_new_tokens_limit,
                queued=len(self._queue),
            )
        return status, body

    def submit(self, body: bytes) -> Pending:
        """Parse, validate and queue a completion request body.

        Raises:
            RequestError: 4xx for a bad request, 503 when full or closing.
        """
        c = self.config
        request = parse_completion(
            body,
            encode=self.generator.encode,
            max_seq_len=self.max_seq_len,
            max_new_tokens_limit=c.max_new_tokens_limit,
            max_total_tokens=c.max_total_tokens,
            default_max_new_tokens=min(64, c.max_new_tokens_limit),
        )
        pending = Pending(request=request)
        if not self.healthy or not self._queue.put(pending):
            reason = (
                "the server is shutting down"
                if not self.healthy
                else (f"the queue is full ({c.max_queued_requests} requests waiting); retry later")
            )
            raise RequestError(503, reason)
        return pending


def follow(generator: TextGenerator, *, on_batch: Callable[[int], None] | None = None) -> None:
    """Decode the batches the tp group's first rank serves, until it closes (a ``stop``).

    Run on every rank of the generator's tp group but the first, with the same model sharded
    the same way; the first rank runs :class:`InferenceServer`. Returns when the server
    closes; raises if the group breaks (a rank died).

    Args:
        generator: This rank's shard of the model.
        on_batch: Called with each batch's size (e.g. to log progress).
    """
    group = generator.tp_group
    if group is None:
        raise ValueError("follow() needs a generator with a tensor-parallel group (tp_group)")
    while True:
        message = broadcast_json(None, group)
        kind = message.get("kind")
        if kind == "stop":
            return
        if kind == "idle":
            continue
        assert kind == "batch", f"unknown message from the serving rank: {kind!r}"
        configs = [SamplingConfig.from_dict(s) for s in message["sampling"]]
        decode_batch(generator, message["prompts"], configs)
        if on_batch is not None:
            on_batch(len(configs))
