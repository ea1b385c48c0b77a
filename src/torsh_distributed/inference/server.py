"""An OpenAI-compatible completion server on FastAPI and uvicorn, batching continuously.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI's
request fields and response shapes, ``"stream": true`` as OpenAI's server-sent-event chunks
ending in ``data: [DONE]``, errors as ``{"error": {"message", "type", "param", "code"}}``; see
:mod:`~torsh_distributed.inference._openai` for what is honoured and refused), ``GET /health``
(whether the model worker is up and, to an authorised caller, what it serves) and
``GET /metrics`` (Prometheus text). Chat prompts are rendered by a
:class:`~torsh_distributed.inference.chat.ChatTemplate`.

**Scheduling.** The HTTP side (FastAPI on uvicorn's event loop, one thread) validates each
request, turns it into rows (prompts x ``n``) and queues them. One model worker thread decodes:

* ``scheduler="continuous"`` (default): iteration-level scheduling. Between two decoding steps
  queued rows join the running batch (up to ``max_batch_size`` rows and ``max_batch_tokens``
  tokens fed per step) and finished rows leave it, each row in its own KV-cache slots
  (:mod:`~torsh_distributed.inference._continuous`). Needs a model with ``forward_cached`` and
  a length bound (``max_seq_len`` or ``max_total_tokens``); otherwise the server warns and
  batches statically.
* ``scheduler="static"``: the worker takes up to ``max_batch_size`` queued rows (waiting up to
  ``batch_wait_ms`` for others to join the first) and decodes them until the longest ends.

Either way a row's tokens are those ``generate`` gives it alone (see
:mod:`~torsh_distributed.inference.generate`). A forward that raises is retried row by row, so
a request that breaks generation gets a 500 and the others their completions.

**Tensor parallelism.** On a tp group of N ranks only the group's first rank serves HTTP. It
sends the other ranks, which run :func:`follow`, what to decode (JSON bytes in a tensor): each
static batch, or each continuous step's joining rows and cancellations; all decode together. An
idle server sends a heartbeat every few seconds so that the others' waits never reach the
process group's timeout, and a ``stop`` message when it closes.

**Security.** Binds ``127.0.0.1`` by default. Any other address requires a token
(:class:`ServerConfig` refuses to start without one); with a token every route but ``/health``
needs ``Authorization: Bearer <token>`` (compared in constant time), and ``/health`` tells an
unauthorised caller only whether the server is up. Request bodies are size-limited and parsed as
JSON by pydantic models; nothing a client sends is unpickled or evaluated. With ``tls_cert`` and
``tls_key`` uvicorn serves HTTPS; off loopback plain HTTP is refused unless ``insecure`` is set
(e.g. behind a TLS-terminating proxy). See docs/security.md.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from torsh_distributed.inference import _openai as oa
from torsh_distributed.inference._continuous import ContinuousBatcher, Join, continuous_max_len
from torsh_distributed.inference._server_config import MIN_TOKEN_LENGTH, ServerConfig, is_loopback
from torsh_distributed.inference._serving import (
    BatchQueue,
    Pending,
    ServingMetrics,
    Sink,
    broadcast_json,
    decode_batch,
)
from torsh_distributed.inference.chat import PYTHON_COMMENTS, ChatTemplate
from torsh_distributed.inference.generate import GenerationResult, TextGenerator
from torsh_distributed.inference.protocol import max_seq_len_of
from torsh_distributed.inference.sampling import SamplingConfig

__all__ = ["ServerConfig", "InferenceServer", "follow", "is_loopback", "MIN_TOKEN_LENGTH"]

HEARTBEAT_S = 5.0
"""Seconds between the idle messages rank 0 sends the other tensor-parallel ranks."""
BACKLOG = 1024
"""Connections the kernel queues before the server accepts them."""
def _prompt_len(pending: Pending) -> int:
    return len(pending.prompt_tokens)


def _vocab_size(model: object) -> int | None:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _bind(host: str, port: int) -> socket.socket:
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"cannot serve on {host}:{port} ({exc.strerror}); choose another --port"
        ) from exc
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


class InferenceServer:
    """Serves :class:`TextGenerator` completions over HTTP until :meth:`close` (see the module
    doc). Starts listening and its model worker at construction.

    Args:
        generator: The model and tokenizer. Under tensor parallelism (its ``tp_group`` has more
            than one rank) this is the group's first rank, and every other rank runs
            :func:`follow` with its own generator.
        config: Address, token, scheduling and limits.
        model_info: What ``/health`` reports about the model to authorised callers (JSON data).
        chat_template: How ``/v1/chat/completions`` renders messages into a prompt; default the
            built-in GPT's :data:`~torsh_distributed.inference.chat.PYTHON_COMMENTS`.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """

    def __init__(
        self,
        generator: TextGenerator,
        config: ServerConfig,
        *,
        model_info: dict[str, Any] | None = None,
        chat_template: ChatTemplate = PYTHON_COMMENTS,
    ) -> None:
        import uvicorn

        from torsh_distributed.inference._http import make_app

        self.generator = generator
        self.config = config
        self.model_info = dict(model_info or {})
        self.chat_template = chat_template
        self.metrics = ServingMetrics()
        self.created = int(time.time())
        self.max_seq_len = (
            generator.max_seq_len
            if generator.max_seq_len is not None
            else max_seq_len_of(generator.model)
        )
        self._limits = oa.Limits(
            max_seq_len=self.max_seq_len,
            max_new_tokens_limit=config.max_new_tokens_limit,
            max_total_tokens=config.max_total_tokens,
            max_rows=config.max_queued_requests,
            vocab_size=_vocab_size(generator.model),
        )
        group = generator.tp_group
        self._group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.scheduler = config.scheduler
        self._slots = continuous_max_len(generator, config.max_total_tokens)
        if self.scheduler == "continuous" and self._slots is None:
            warnings.warn(
                "server.scheduler 'continuous' needs a model with forward_cached (a KV cache) "
                "and a length bound (max_seq_len or server.max_total_tokens): batching "
                "statically",
                stacklevel=2,
            )
            self.scheduler = "static"
        self._queue = BatchQueue(max_size=config.max_queued_requests)
        self._closing = threading.Event()
        self._failure: BaseException | None = None
        self._live: dict[int, Pending] = {}
        self._current: list[Pending] = []
        sock = _bind(config.host, config.port)
        self.host, self.port = sock.getsockname()[:2]
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(
                make_app(self),
                log_level="warning",
                access_log=False,
                server_header=False,
                ws="none",
                lifespan="off",
                timeout_keep_alive=5,
                timeout_graceful_shutdown=5,
                backlog=BACKLOG,
                ssl_certfile=config.tls_cert,
                ssl_keyfile=config.tls_key,
            )
        )
        self._worker = threading.Thread(target=self._work, name="torsh-serve-model", daemon=True)
        self._worker.start()
        self._http = threading.Thread(
            target=self._uvicorn.run,
            kwargs={"sockets": [sock]},
            name="torsh-serve-http",
            daemon=True,
        )
        self._http.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started and self._http.is_alive():
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start within 30 s")
            time.sleep(0.01)
        if not self._uvicorn.started:
            self.close()
            raise RuntimeError("the HTTP server stopped while starting (see the log)")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        return self.config.model_name

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
        """Stop: answer queued requests with 503, let the rows being decoded finish and be
        answered, release the other tensor-parallel ranks, stop accepting connections (uvicorn's
        graceful shutdown lets open answers finish, 5 s at most), free the port. Safe to call
        twice."""
        if self._closing.is_set():
            return
        self._closing.set()
        for pending in self._queue.close():
            pending.fail(503, "the server is shutting down")
        self._worker.join(timeout=timeout)
        self._uvicorn.should_exit = True
        self._http.join(timeout=15.0)

    # -- the HTTP side's calls (see _http.App) -------------------------------------------
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
                model_name=self.model_name,
                tp=tp,
                scheduler=self.scheduler,
                max_seq_len=self.max_seq_len,
                max_batch_size=self.config.max_batch_size,
                max_new_tokens_limit=self.config.max_new_tokens_limit,
                queued=len(self._queue),
                running=len(self._live) or len(self._current),
            )
        return status, body

    def models(self) -> list[dict[str, Any]]:
        return [
            {
                "id": self.model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "torsh-distributed",
                "max_model_len": self.max_seq_len,
            }
        ]

    def decoder(self) -> Callable[[list[int]], str]:
        return self.generator.decode

    def plan(self, kind: str, body: bytes) -> oa.Plan:
        """A request body parsed and checked against the limits (raises ``APIError``)."""
        common = {
            "model_name": self.model_name,
            "encode": self.generator.encode,
            "limits": self._limits,
        }
        if kind == "chat":
            request = oa.parse(oa.ChatCompletionRequest, body)
            plan = oa.plan_chat(request, template=self.chat_template, **common)
        else:
            plan = oa.plan_completion(oa.parse(oa.CompletionRequest, body), **common)
        if plan.logprobs is not None and self.scheduler != "continuous":
            raise oa.APIError(
                400,
                "logprobs needs the continuous scheduler (--scheduler continuous)",
                param="logprobs",
            )
        return plan

    def submit(self, plan: oa.Plan, sink: Sink) -> list[Pending]:
        """Queue a plan's rows, all or none (raises ``APIError`` 503 when full or closing)."""
        rows = [
            Pending(
                prompt_tokens=c.tokens,
                sampling=c.sampling,
                stream=plan.stream,
                choice=i,
                sink=sink,
                logprobs=plan.logprobs,
            )
            for i, c in enumerate(plan.choices)
        ]
        if not self.healthy:
            raise oa.APIError(503, "the server is shutting down")
        if not self._queue.put(rows):
            raise oa.APIError(
                503,
                f"the queue is full ({self.config.max_queued_requests} rows waiting); retry later",
            )
        return rows

    # -- model worker ---------------------------------------------------------------------
    def _work(self) -> None:
        try:
            if self.scheduler == "continuous":
                self._continuous()
            else:
                self._static()
        except BaseException as exc:  # noqa: BLE001 - a broken tp group ends the worker
            self._failure = exc
            print(
                f"torsh-dist serve: the model worker stopped: {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            for pending in [*self._current, *self._live.values(), *self._queue.close()]:
                if pending.finished is None:
                    pending.fail(503, "the model worker stopped")
            return
        if self._group is not None:
            broadcast_json({"kind": "stop"}, self._group)

    def _static(self) -> None:
        c = self.config
        while True:
            batch = self._queue.next_batch(
                max_batch_size=c.max_batch_size, wait_s=c.batch_wait_ms / 1000.0, idle_s=HEARTBEAT_S
            )
            if batch is None:
                return
            if not batch:
                if self._group is not None:
                    broadcast_json({"kind": "idle"}, self._group)
                continue
            self._decode(batch)

    def _decode(self, batch: list[Pending]) -> None:
        self._current = batch
        self.metrics.batch(len(batch), len(self._queue))
        prompts = [p.prompt_tokens for p in batch]
        configs = [p.sampling for p in batch]
        if self._group is not None:
            message = {
                "kind": "batch",
                "prompts": prompts,
                "sampling": [s.to_dict() for s in configs],
            }
            broadcast_json(message, self._group)

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
            self._finish(pending, result)
        self._current = []

    def _finish(self, pending: Pending, result: GenerationResult | BaseException) -> None:
        if isinstance(result, GenerationResult):
            pending.done(result)
            assert pending.started is not None and pending.finished is not None
            ttft = pending.started - pending.arrived + result.time_to_first_token_s
            self.metrics.completion(result, ttft_s=ttft, total_s=pending.finished - pending.arrived)
            return
        print(
            "torsh-dist serve: generation failed:\n"
            + "".join(traceback.format_exception(type(result), result, result.__traceback__)),
            file=sys.stderr,
            flush=True,
        )
        pending.fail(500, f"generation failed: {type(result).__name__} (see the server log)")

    def _continuous(self) -> None:
        assert self._slots is not None
        c = self.config
        engine = ContinuousBatcher(
            self.generator,
            max_rows=c.max_batch_size,
            max_len=self._slots,
            max_batch_tokens=c.max_batch_tokens,
        )
        if self._group is not None:
            shape = {"max_rows": c.max_batch_size, "max_len": self._slots}
            broadcast_json(
                {"kind": "engine", "max_batch_tokens": c.max_batch_tokens, **shape}, self._group
            )
        live, next_id = self._live, 0
        while True:
            wait = 0.0 if engine.running else HEARTBEAT_S
            taken = self._queue.take(fits=engine.admission(_prompt_len), wait_s=wait)
            if taken is None and not engine.running:
                return
            cancel = [i for i, p in live.items() if p.cancelled]
            joins = []
            for p in taken or []:
                if p.cancelled:  # its client left while it waited
                    continue
                p.begin_attempt()
                live[next_id] = p
                joins.append(
                    Join(
                        id=next_id, prompt=p.prompt_tokens, sampling=p.sampling, logprobs=p.logprobs
                    )
                )
                next_id += 1
            if not joins and not engine.running:
                if self._group is not None:
                    broadcast_json({"kind": "idle"}, self._group)
                continue
            if self._group is not None:
                message = {"kind": "step", "join": [j.to_json() for j in joins], "cancel": cancel}
                broadcast_json(message, self._group)
            self.metrics.batch(engine.running + len(joins) - len(cancel), len(self._queue))
            events = engine.step(joins, cancel)
            for i in cancel:
                live.pop(i, None)
            for rid, kind, value in events:
                if kind == "token":
                    live[rid].token(value)
                elif kind == "logprob":
                    live[rid].logprob(value)
                else:
                    self._finish(live.pop(rid), value)


def follow(generator: TextGenerator, *, on_batch: Callable[[int], None] | None = None) -> None:
    """Decode what the tp group's first rank serves, until it closes (a ``stop``).

    Run on every rank of the generator's tp group but the first, with the same model sharded
    the same way; the first rank runs :class:`InferenceServer`. Returns when the server
    closes; raises if the group breaks (a rank died).

    Args:
        generator: This rank's shard of the model.
        on_batch: Called with each static batch's size, or each continuous step's row count
            (e.g. to log progress).
    """
    group = generator.tp_group
    if group is None:
        raise ValueError("follow() needs a generator with a tensor-parallel group (tp_group)")
    engine: ContinuousBatcher | None = None
    while True:
        message = broadcast_json(None, group)
        kind = message.get("kind")
        if kind == "stop":
            return
        if kind == "idle":
            continue
        if kind == "engine":
            engine = ContinuousBatcher(
                generator,
                max_rows=message["max_rows"],
                max_len=message["max_len"],
                max_batch_tokens=message["max_batch_tokens"],
            )
            continue
        if kind == "step":
            assert engine is not None, "a step before the engine's shape"
            joins = [Join.from_json(j) for j in message["join"]]
            engine.step(joins, message["cancel"])
            if on_batch is not None:
                on_batch(engine.running)
            continue
        assert kind == "batch", f"unknown message from the serving rank: {kind!r}"
        configs = [SamplingConfig.from_dict(s) for s in message["sampling"]]
        decode_batch(generator, message["prompts"], configs)
        if on_batch is not None:
            on_batch(len(configs))
