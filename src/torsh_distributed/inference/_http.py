"""The HTTP side of :mod:`torsh_distributed.inference.server` (private): the request handler
(routes, token check, body limit, JSON and server-sent-event answers) and the listening socket.

The handler answers for any :class:`App` (the server implements it), so this module does not
import the server that imports it.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlparse

from torsh_distributed.inference._serving import Pending, RequestError, ServingMetrics, answer

__all__ = ["App", "InFlight", "bind", "ROUTES"]

ROUTES = ("/v1/completions", "/health", "/metrics")
BACKLOG = 1024
"""Connections the kernel queues before the server accepts them."""
LINGER_S = 1.0
LINGER_BYTES = 4 << 20
"""How long, and how much of an unread body, an early answer (401, 411, 413) waits for."""


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


class Settings(Protocol):
    """The settings the handler reads (a :class:`~.server.ServerConfig`)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def request_timeout_s(self) -> float: ...


class App(Protocol):
    """What the handler asks of the server it answers for (an :class:`~.server.InferenceServer`)."""

    @property
    def config(self) -> Settings: ...
    @property
    def metrics(self) -> ServingMetrics: ...
    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value carries the token (or none is needed)."""
        ...

    def health(self, authorized: bool) -> tuple[int, dict[str, Any]]:
        """The status and body of ``GET /health``."""
        ...

    def submit(self, body: bytes) -> Pending:
        """Parse and queue a completion request; raises :class:`RequestError` (4xx/5xx)."""
        ...


class InFlight:
    """Counts the requests being handled, so that closing can wait for their last answers."""

    def __init__(self) -> None:
        self._count = 0
        self._cond = threading.Condition()

    def __enter__(self) -> None:
        with self._cond:
            self._count += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    def wait_idle(self, *, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._count == 0, timeout=timeout)


class _Handler(BaseHTTPRequestHandler):
    server_version = "torsh-serve"
    sys_version = ""  # do not advertise the Python version
    timeout = 30  # seconds a client may take to send its request
    app: App  # set on the subclass made by bind
    inflight: InFlight

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def handle(self) -> None:
        with self.inflight:
            super().handle()

    def _route(self) -> str:
        path = urlparse(self.path).path
        return path if path in ROUTES else "other"

    def _send(
        self,
        status: int,
        body: bytes,
        kind: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.app.metrics.request(self._route(), status)
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._send(status, _json({"error": message}), headers=headers)

    def _check_auth(self) -> bool:
        if self.app.authorized(self.headers.get("Authorization")):
            return True
        self._error(
            401,
            "missing or wrong token: send 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": 'Bearer realm="torsh-serve"'},
        )
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        route = self._route()
        if route == "/health":
            status, body = self.app.health(self.app.authorized(self.headers.get("Authorization")))
            self._send(status, _json(body))
        elif route == "/metrics":
            if not self._check_auth():
                return
            text = self.app.metrics.text()
            if text is None:
                self._error(
                    501, "metrics need prometheus_client: pip install 'torsh-distributed[monitor]'"
                )
            else:
                self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif route == "/v1/completions":
            self._error(405, "use POST for /v1/completions", {"Allow": "POST"})
        else:
            self._error(404, f"no route {urlparse(self.path).path}; routes: {', '.join(ROUTES)}")

    def do_POST(self) -> None:  # noqa: N802
        route = self._route()
        if route != "/v1/completions":
            if route == "other":
                self._error(
                    404, f"no route {urlparse(self.path).path}; routes: {', '.join(ROUTES)}"
                )
            else:
                self._error(405, f"use GET for {route}", {"Allow": "GET"})
            return
        if not self._check_auth():
            self._linger()
            return
        body = self._read_body()
        if body is None:
            self._linger()
            return
        try:
            pending = self.app.submit(body)
        except RequestError as exc:
            self._error(exc.status, str(exc))
            return
        if pending.request.stream:
            self._stream(pending)
        else:
            self._complete(pending)

    def _linger(self) -> None:
        """After answering without reading the body: stop sending, then discard what the client
        still sends for a moment. Closing a socket with unread data makes the kernel reset the
        connection, which can destroy the answer before the client reads it."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            deadline, left = time.monotonic() + LINGER_S, LINGER_BYTES
            while left > 0 and time.monotonic() < deadline:
                chunk = self.connection.recv(min(left, 65536))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    def _read_body(self) -> bytes | None:
        limit = self.app.config.max_body_bytes
        if self.headers.get("Transfer-Encoding"):
            self._error(411, "send the body with a Content-Length (no chunked request bodies)")
            return None
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self._error(411, "Content-Length is required")
            return None
        try:
            length = int(length_header)
            if length < 0:
                raise ValueError
        except ValueError:
            self._error(400, f"Content-Length must be a byte count, got {length_header!r}")
            return None
        if length > limit:
            self.close_connection = True  # the unread body must not be parsed as a request
            self._error(413, f"the body is {length} bytes, more than the limit of {limit}")
            return None
        try:
            return self.rfile.read(length)
        except OSError:
            self.close_connection = True
            return None

    def _next(self, pending: Pending, deadline: float) -> tuple[str, Any]:
        try:
            return pending.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return ("error", (504, f"no answer within {self.app.config.request_timeout_s} s"))

    def _complete(self, pending: Pending) -> None:
        deadline = time.monotonic() + self.app.config.request_timeout_s
        while True:
            kind, value = self._next(pending, deadline)
            if kind == "done":
                self._send(200, _json(answer(pending, value)))
                return
            if kind == "error":
                self._error(*value)
                return

    def _stream(self, pending: Pending) -> None:
        deadline = time.monotonic() + self.app.config.request_timeout_s
        self.app.metrics.request(self._route(), 200)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        index = 0
        try:
            while True:
                kind, value = self._next(pending, deadline)
                if kind == "token":
                    self._event("token", {"index": index, "token": value})
                    index += 1
                    continue
                if kind == "done":
                    self._event("done", answer(pending, value))
                else:
                    status, message = value
                    self._event("error", {"error": message, "status": status})
                return
        except OSError:  # the client went away; its row finishes with its batch
            return

    def _event(self, name: str, data: dict[str, Any]) -> None:
        self.wfile.write(f"event: {name}\ndata: ".encode() + _json(data) + b"\n\n")
        self.wfile.flush()


def bind(app: App, inflight: InFlight) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for ``app`` on its configured address.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """
    handler = type("Handler", (_Handler,), {"app": app, "inflight": inflight})
    host, port = app.config.host.strip("[]"), app.config.port
    # socketserver's default backlog of 5 resets connections when many clients connect at once
    attrs: dict[str, Any] = {"request_queue_size": BACKLOG, "daemon_threads": True}
    if ":" in host:  # an IPv6 address
        attrs["address_family"] = socket.AF_INET6
    server_cls = type("ServeHTTPServer", (ThreadingHTTPServer,), attrs)
    try:
        httpd = server_cls((host, port), handler)
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot serve on {host}:{port} ({exc.strerror}); choose another --port"
        ) from exc
    return httpd
