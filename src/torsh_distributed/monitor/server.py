"""The live dashboard's HTTP server (stdlib ``http.server``), run by rank 0 in a daemon thread.

Routes: ``/`` and the static files of ``monitor/dashboard/`` (HTML, JS, CSS; nothing is fetched
from the internet), ``GET /api/state`` (the JSON the page polls), ``POST /api/ack?rule=NAME``
(acknowledge an active alert; applied by the training thread at its next aggregation).

The training thread publishes a ready-made JSON document at each aggregation; requests only copy
bytes under a lock, so a browser polling the page costs training nothing measurable.
"""

from __future__ import annotations

import json
import queue
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

__all__ = ["DashboardServer", "ASSETS"]

ASSETS = Path(__file__).with_name("dashboard")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".json": "application/json"}


class DashboardServer:
    """Serves the dashboard on ``host:port`` until :meth:`close`.

    Args:
        host: Bind address; loopback by default (no authentication: anyone who can reach the
            port can read the metrics and acknowledge alerts).
        port: TCP port (0 = any free port; see :attr:`port`).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._state = b"{}"
        self.acks: queue.Queue[str] = queue.Queue()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = urlparse(self.path).path
                if path == "/api/state":
                    with server._lock:
                        body = server._state
                    self._reply(HTTPStatus.OK, body, "application/json")
                    return
                name = "index.html" if path in ("/", "") else path.lstrip("/")
                file = (ASSETS / name).resolve()
                if file.parent != ASSETS.resolve() or not file.is_file():
                    self._reply(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
                    return
                self._reply(HTTPStatus.OK, file.read_bytes(), _TYPES.get(file.suffix, "text/plain"))

            def do_POST(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                rule = parse_qs(url.query).get("rule", [""])[0]
                if url.path != "/api/ack" or not rule:
                    self._reply(HTTPStatus.BAD_REQUEST, b'{"error": "POST /api/ack?rule=NAME"}',
                                "application/json")
                    return
                server.acks.put(rule)
                self._reply(HTTPStatus.ACCEPTED, json.dumps({"queued": rule}).encode(), "application/json")

            def _reply(self, status: HTTPStatus, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot serve the dashboard on {host}:{port} ({exc.strerror}); "
                "choose another --dashboard-port"
            ) from exc
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
            name="torsh-dashboard", daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def publish(self, state: dict[str, Any], *, raw: dict[str, str] | None = None) -> None:
        """Replace the document served at ``/api/state``.

        ``raw`` adds fields whose values are already JSON text (large series serialised
        incrementally by the caller, so publishing does not re-format every number).
        """
        body = json.dumps(state, allow_nan=False, default=str).encode()
        if raw:
            extra = ",".join(f"{json.dumps(k)}:{v}" for k, v in raw.items()).encode()
            body = body[:-1] + (b"," if len(body) > 2 else b"") + extra + b"}"
        with self._lock:
            self._state = body

    def pending_acks(self) -> list[str]:
        """Rules acknowledged through the page since the last call."""
        out = []
        while True:
            try:
                out.append(self.acks.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
