"""The HTTP side of :mod:`torsh_distributed.inference.server` (private): the FastAPI application
(routes, OpenAI error bodies, server-sent events) and the ASGI guard in front of it (bearer
token, body limit, slow-body timeout, request counts).

The application answers for any :class:`App` (the server implements it), so this module does not
import the server that imports it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from torsh_distributed.inference import _openai as oa
from torsh_distributed.inference._serving import Pending, ServingMetrics, Sink
from torsh_distributed.inference.generate import GenerationResult
from torsh_distributed.inference.text import TextStream

__all__ = ["App", "make_app", "ROUTES"]

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
BODY_TIMEOUT_S = 30.0
"""Seconds a client may take to send its request body (408 after)."""
LINGER_BYTES = 4 << 20
"""How much of a refused body (401, 413) is read and discarded before answering, so that
closing the connection with unread data does not reset it before the client reads the answer."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Settings(Protocol):
    """The settings the HTTP side reads (a :class:`~.server.ServerConfig`)."""

    @property
    def token(self) -> str | None: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def request_timeout_s(self) -> float: ...


class App(Protocol):
    """What the HTTP side asks of the server it answers for (an :class:`~.server.InferenceServer`)."""

    @property
    def config(self) -> Settings: ...
    @property
    def metrics(self) -> ServingMetrics: ...
    @property
    def model_name(self) -> str: ...
    def health(self, authorized: bool) -> tuple[int, dict[str, Any]]:
        """The status and body of ``GET /health``."""
        ...

    def models(self) -> list[dict[str, Any]]:
        """The ``data`` of ``GET /v1/models``."""
        ...

    def plan(self, kind: str, body: bytes) -> oa.Plan:
        """Parse and check a request body; raises :class:`~._openai.APIError`."""
        ...

    def submit(self, plan: oa.Plan, sink: Sink) -> list[Pending]:
        """Queue a plan's rows; raises :class:`~._openai.APIError` (503) when full or closing."""
        ...

    def decoder(self) -> Callable[[list[int]], str]:
        """The tokenizer's ``decode``, for streamed text."""
        ...


def authorized(token: str | None, header: str | None) -> bool:
    """Whether an ``Authorization`` header value grants access (always, without a token)."""
    if token is None:
        return True
    scheme, _, value = (header or "").partition(" ")
    # compare_digest on bytes of any length: the time does not depend on the content
    return scheme.lower() == "bearer" and hmac.compare_digest(
        value.strip().encode(), token.encode()
    )


def _error(status: int, message: str, **kw: Any) -> JSONResponse:
    headers = kw.pop("headers", None)
    return JSONResponse(oa.error_body(status, message, **kw), status_code=status, headers=headers)


class _TooLarge(Exception):
    pass


class Guard:
    """ASGI middleware before every route: counts answers by route and status, checks the
    bearer token (every route but ``/health``), refuses bodies over the limit (by their
    ``Content-Length``, or while reading a chunked one) and bodies sent too slowly."""

    def __init__(self, app: Callable[..., Awaitable[None]], server: App) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"
        metrics = self.server.metrics

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                metrics.request(route, message["status"])
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        config = self.server.config
        if path != "/health" and not authorized(config.token, headers.get("authorization")):
            await self._refuse(
                receive,
                counted,
                scope,
                _error(
                    401,
                    "missing or wrong token: send 'Authorization: Bearer <token>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="torsh-serve"'},
                ),
            )
            return
        limit = config.max_body_bytes
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            refusal = (
                _error(400, f"Content-Length must be a byte count, got {length!r}")
                if not length.isdigit()
                else _error(413, f"the body is {length} bytes, more than the limit of {limit}")
            )
            await self._refuse(receive, counted, scope, refusal)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(f"the body is more than the limit of {limit} bytes")
            return message

        await self.app(scope, limited, counted)

    async def _refuse(self, receive: Receive, send: Send, scope: Scope, answer: Response) -> None:
        """Answer without the body, after discarding what the client sends of it (bounded)."""
        left, deadline = LINGER_BYTES, time.monotonic() + 1.0
        try:
            while left > 0:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                if message["type"] != "http.request":
                    break
                left -= len(message.get("body", b""))
                if not message.get("more_body"):
                    break
        except (TimeoutError, asyncio.TimeoutError):
            pass
        await answer(scope, receive, send)


async def _body(request: Request) -> bytes:
    try:
        return await asyncio.wait_for(request.body(), BODY_TIMEOUT_S)
    except _TooLarge as exc:
        raise oa.APIError(413, str(exc)) from None
    except (TimeoutError, asyncio.TimeoutError):
        raise oa.APIError(408, f"the body did not arrive within {BODY_TIMEOUT_S:.0f} s") from None


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def _watch_disconnect(request: Request, rows: list[Pending]) -> None:
    """Mark ``rows`` cancelled when the client disconnects (the body was read already, so the
    next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for row in rows:
                row.cancelled = True
            return


def make_app(server: App) -> Any:
    """The ASGI application of ``server``: FastAPI behind a :class:`Guard`."""
    api = FastAPI(title="torsh-dist serve", docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(oa.APIError)
    async def _api_error(_: Request, exc: oa.APIError) -> JSONResponse:
        return _error(exc.status, exc.message, param=exc.param, code=exc.code)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (
            f"no route {request.url.path}; routes: {', '.join(ROUTES)}"
            if exc.status_code == 404
            else f"method {request.method} not allowed for {request.url.path}"
            if exc.status_code == 405
            else str(exc.detail)
        )
        return _error(exc.status_code, message, headers=dict(exc.headers or {}))

    @api.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__} (see the server log)")

    @api.get("/health")
    async def health(request: Request) -> JSONResponse:
        ok = authorized(server.config.token, request.headers.get("authorization"))
        status, body = server.health(ok)
        return JSONResponse(body, status_code=status)

    @api.get("/metrics")
    async def metrics() -> Response:
        text = server.metrics.text()
        if text is None:
            return _error(
                501, "metrics need prometheus_client: pip install 'torsh-distributed[monitor]'"
            )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": server.models()})

    @api.get("/v1/models/{name:path}")
    async def model(name: str) -> JSONResponse:
        for entry in server.models():
            if entry["id"] == name:
                return JSONResponse(entry)
        raise oa.APIError(404, f"the model {name!r} does not exist", code="model_not_found")

    async def run(request: Request, kind: str) -> Response:
        plan = server.plan(kind, await _body(request))
        sink = Sink(asyncio.get_running_loop())
        rows = server.submit(plan, sink)
        if plan.stream:
            return StreamingResponse(
                _stream(server, plan, rows, sink),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-store"},
            )
        watcher = asyncio.create_task(_watch_disconnect(request, rows))
        try:
            results = await _collect(server, rows, sink)
        finally:
            watcher.cancel()
        if isinstance(results, JSONResponse):
            return results
        body = oa.response(
            plan,
            results,
            rid=oa.new_id(kind),
            model_name=server.model_name,
            logprobs=[row.logprob_values for row in rows],
            decode=server.decoder(),
        )
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await run(request, "chat")

    return Guard(api, server)


async def _next(sink: Sink, deadline: float, timeout_s: float) -> tuple[str, int, Any]:
    try:
        return await asyncio.wait_for(sink.queue.get(), max(0.0, deadline - time.monotonic()))
    except (TimeoutError, asyncio.TimeoutError):
        return ("error", -1, (504, f"no answer within {timeout_s} s"))


async def _collect(
    server: App, rows: list[Pending], sink: Sink
) -> list[GenerationResult] | JSONResponse:
    timeout = server.config.request_timeout_s
    deadline = time.monotonic() + timeout
    results: dict[int, GenerationResult] = {}
    while len(results) < len(rows):
        kind, choice, value = await _next(sink, deadline, timeout)
        if kind == "done":
            results[choice] = value
        elif kind == "error":
            for row in rows:
                row.cancelled = True
            status, message = value
            return _error(status, message)
    return [results[i] for i in range(len(rows))]


async def _stream(
    server: App, plan: oa.Plan, rows: list[Pending], sink: Sink
) -> AsyncIterator[bytes]:
    rid, created, name = oa.new_id(plan.kind), int(time.time()), server.model_name
    decode = server.decoder()
    texts = [
        TextStream(
            decode, stop_strings=row.sampling.stop_strings, stop_tokens=row.sampling.stop_tokens
        )
        for row in rows
    ]
    timeout = server.config.request_timeout_s
    deadline = time.monotonic() + timeout
    left, generated = len(rows), 0
    # logprobs not yet sent, per choice: (tokens, entries), and the tokens already reported
    waiting: list[tuple[list[int], list[oa.LogprobEntry]]] = [([], []) for _ in rows]
    reported: list[list[int]] = [[] for _ in rows]

    def piece(index: int, text: str | None, **kw: Any) -> bytes:
        block = None
        tokens, entries = waiting[index]
        if entries:
            block = oa.logprobs_block(plan, tokens, entries, decode, before=reported[index])
            reported[index] += tokens
            waiting[index] = ([], [])
        chunk = oa.chunk(
            plan,
            rid=rid,
            model_name=name,
            created=created,
            index=index,
            text=text,
            logprobs=block,
            **kw,
        )
        return _sse(chunk)

    try:
        if plan.kind == "chat":
            for index in range(len(rows)):
                yield piece(index, "", role=True)
        while left:
            kind, index, value = await _next(sink, deadline, timeout)
            if kind == "logprob":
                waiting[index][1].append(value)
            elif kind == "token":
                delta = texts[index].push(value)
                if plan.logprobs is not None:
                    waiting[index][0].append(value)
                ids = [value] if plan.return_token_ids else None
                if delta or ids:
                    yield piece(index, delta, token_ids=ids)
            elif kind == "done":
                left -= 1
                generated += len(value.tokens)
                rest = texts[index].finish(value.text or "")
                if rest:
                    yield piece(index, rest)
                empty = None if plan.kind == "chat" else ""
                yield piece(index, empty, finish=oa.finish_reason(value))
            else:
                status, message = value
                yield _sse(oa.error_body(status, message))
                break
        else:
            if plan.include_usage:
                prompt_chunk = oa.usage_chunk(
                    plan, rid=rid, model_name=name, created=created, completion=generated
                )
                yield _sse(prompt_chunk)
        yield b"data: [DONE]\n\n"
    finally:
        for row in rows:  # the client left, or the stream ended: running rows are dropped
            row.cancelled = True
