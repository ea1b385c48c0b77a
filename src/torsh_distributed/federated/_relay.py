"""A token-authenticated TCP relay that keeps an exposed federation's SuperLink on loopback.

Flower's SuperLink serves its Fleet API (the SuperNodes) and its Control API (run submission) on
one HTTP port, and its own node authentication needs TLS certificates. A federation over hosts
therefore never exposes that port: the SuperLink listens on 127.0.0.1 of the head host and a
:class:`Relay` in ``server`` role listens on the exposed address; on each client host a relay in
``client`` role listens on 127.0.0.1 for the SuperNode and forwards to the head. Every connection
starts with a mutual challenge-response on the shared token (HMAC-SHA256 of a fresh random nonce
each way, compared in constant time, 5 s to answer); a peer without the token is disconnected
before a single byte reaches Flower.

Without TLS the bytes after the handshake are not encrypted: run it on a network you trust, or
under a VPN/SSH tunnel. With ``tls`` contexts (:mod:`torsh_distributed.runtime.tls`) the relays
speak TLS to each other: the client relay verifies the head's certificate against the CA (and the
head's address against its names), the head requires a client certificate signed by that CA
(mutual TLS: a node without one is refused during the handshake, before the token is even asked
for), and the token handshake and everything after it are encrypted. Failures are counted and the
first of each kind is reported in one line (``report``). See docs/security.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Relay"]

_NONCE = 32
_HANDSHAKE_S = 5.0
_CHUNK = 1 << 16


def _mac(token: bytes, nonce: bytes, who: bytes) -> bytes:
    return hmac.new(token, who + nonce, hashlib.sha256).digest()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close (the other direction may still be answering); a TLS
    stream cannot half-close, so it closes (HTTP/2 and gRPC never half-close a live stream)."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except (ConnectionError, OSError):
        writer.close()


@dataclass
class Relay:
    """Forward ``listen`` to ``target`` for peers that prove they hold ``token``.

    Args:
        role: ``server`` (accept remote peers, check them, forward to the local SuperLink) or
            ``client`` (accept the local SuperNode, prove the token to the remote relay).
        listen: (host, port) to listen on; port 0 = a free one (see :attr:`port` after start).
        target: (host, port) to forward to.
        token: The shared secret (at least 16 bytes).
        tls: TLS context: a server context (with a CA: client certificates required) for the
            ``server`` role, a client context (CA to trust, this node's certificate) for the
            ``client`` role; ``None`` = plain TCP.
        report: Receives one line per kind of TLS failure (default: stderr).
    """

    role: str
    listen: tuple[str, int]
    target: tuple[str, int]
    token: bytes
    tls: ssl.SSLContext | None = field(default=None, repr=False)
    report: Callable[[str], None] | None = field(default=None, repr=False)
    port: int = 0
    refused: int = 0
    """Connections dropped for a wrong or missing token (server role)."""
    tls_refused: int = 0
    """Connections whose TLS handshake failed: no or a wrong certificate, a wrong CA."""
    _reported: set[str] = field(default_factory=set, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _server: asyncio.base_events.Server | None = field(default=None, repr=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, repr=False)
    _closing: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ("server", "client"):
            raise ValueError(f"relay role must be server or client, got {self.role!r}")
        if len(self.token) < 16:
            raise ValueError("the federation token must be at least 16 characters")

    def _tls_failure(self, exc: BaseException) -> None:
        self.tls_refused += 1
        reason = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or str(exc)
        if self.role == "server":
            line = f"federation relay: refused a node: TLS handshake failed ({reason}); nodes need a certificate signed by the federation's CA"
        else:
            head = f"{self.target[0]}:{self.target[1]}"
            line = f"federation relay: cannot join {head} over TLS ({reason}): is --tls-ca the federation's CA?"
        if line not in self._reported:
            self._reported.add(line)
            (self.report or (lambda text: print(text, file=sys.stderr, flush=True)))(line)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:  # accepted while stop() closes everything: not served
            writer.transport.abort()
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            try:
                if self.role == "server":
                    up_reader, up_writer = await self._accept_peer(reader, writer)
                else:
                    up_reader, up_writer = await self._join_head()
            except ssl.SSLError as exc:
                self._tls_failure(exc)
                return
            except (ConnectionError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, PermissionError):
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            # every connection is closed here, also when stop() cancels this task (at once then,
            # unsent bytes dropped): a transport left open is closed later by the garbage
            # collector, from whatever thread runs it
            for end in (writer, up_writer):
                if end is None:
                    continue
                if self._closing:
                    end.transport.abort()
                else:
                    end.close()
            if task is not None:
                self._tasks.discard(task)

    async def _accept_peer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.tls is not None:  # here, not in start_server: a failed handshake is then ours to report
            await writer.start_tls(self.tls, ssl_handshake_timeout=_HANDSHAKE_S)
        nonce = os.urandom(_NONCE)
        writer.write(nonce)
        await writer.drain()
        answer = await asyncio.wait_for(reader.readexactly(32 + _NONCE), _HANDSHAKE_S)
        if not hmac.compare_digest(answer[:32], _mac(self.token, nonce, b"node")):
            self.refused += 1
            raise PermissionError("wrong token")
        writer.write(_mac(self.token, answer[32:], b"head"))  # prove ourselves to the node
        await writer.drain()
        return await asyncio.open_connection(*self.target)

    async def _join_head(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        tls = {"ssl": self.tls, "server_hostname": self.target[0]} if self.tls is not None else {}
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target, **tls), _HANDSHAKE_S)
        try:
            nonce = await asyncio.wait_for(up_reader.readexactly(_NONCE), _HANDSHAKE_S)
            mine = os.urandom(_NONCE)
            up_writer.write(_mac(self.token, nonce, b"node") + mine)
            await up_writer.drain()
            proof = await asyncio.wait_for(up_reader.readexactly(32), _HANDSHAKE_S)
            if not hmac.compare_digest(proof, _mac(self.token, mine, b"head")):
                raise PermissionError("the head relay does not hold the token")
        except BaseException:
            up_writer.close()
            raise
        return up_reader, up_writer

    def start(self) -> Relay:
        """Listen in a background thread; returns once listening (``port`` is set)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._handle, *self.listen))
                self.port = int(self._server.sockets[0].getsockname()[1])
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                failure.append(exc)
                loop.close()
                ready.set()
                return
            ready.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"torsh-relay-{self.role}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise OSError(f"the federation relay cannot listen on {self.listen[0]}:{self.listen[1]}: {failure[0]}")
        return self

    def stop(self) -> None:
        """Stop listening and close every connection, in the relay's own thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        if threading.current_thread() is thread:
            raise RuntimeError("Relay.stop() was called from the relay's own thread")
        try:
            asyncio.run_coroutine_threadsafe(self._close_all(), loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - a wedged or stopping loop (3.10: futures' own errors)
            pass
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)

    async def _close_all(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for _ in range(2):  # connections accepted but not yet started see _closing and close
            await asyncio.sleep(0)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(3):  # the transports' closing callbacks run on the next iterations
            await asyncio.sleep(0)
