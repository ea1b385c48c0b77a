"""Coordination stores from one URL: in-memory, file, TCP (torch's) and Redis (ours).

A store is the small key-value service ranks rendezvous through before any collective exists.
:func:`create_store` builds any of them from a URL, so a launcher flag or config field is enough::

    store = create_store("tcp://10.0.0.5:29500", rank=rank, world_size=world_size)
    store = create_store("redis://10.0.0.5:6379/0?prefix=job42/", password=token)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)

Which one: ``memory://`` for a single process (tests); ``file:///shared/path`` when all ranks see
one file system and no port can be opened; ``tcp://`` (torch's TCPStore, served by rank 0) for
most jobs; ``redis://`` when an external server should outlive the ranks (elastic jobs, no rank
fit to host the store).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import parse_qs, unquote, urlsplit

import torch.distributed as dist

from torsh_distributed.runtime.errors import (
    CommunicationError,
    DistributedTimeoutError,
    RankOutOfRangeError,
)
from torsh_distributed.runtime.redis_store import DEFAULT_STORE_TIMEOUT, RedisStore

__all__ = ["create_store", "STORE_URL_FORMS", "DEFAULT_STORE_TIMEOUT"]

STORE_URL_FORMS = (
    "memory://",
    "file:///absolute/path",
    "tcp://host:port",
    "redis://[:password@]host:port[/db][?prefix=...]",
)
"""The URL forms :func:`create_store` accepts."""

_DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class _StoreURL:
    scheme: str
    host: str = _DEFAULT_HOST
    port: int = 0
    path: str = ""
    db: int = 0
    password: str | None = field(default=None, repr=False)
    prefix: str | None = None


def _redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (URLs end up in logs and tracebacks)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{netloc}").geturl()


def _bad(url: str, why: str) -> ValueError:
    forms = ", ".join(STORE_URL_FORMS)
    return ValueError(f"bad store URL {_redact(url)!r}: {why}; use one of: {forms}")


def _parse_url(url: str) -> _StoreURL:
    """Split a store URL into its parts; raise ``ValueError`` naming the accepted forms."""
    if not isinstance(url, str):
        raise TypeError(f"store URL must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if "://" not in url or scheme not in ("memory", "file", "tcp", "redis"):
        raise _bad(url, f"unknown scheme {parts.scheme or '(none)'!r}")
    if scheme == "memory":
        if parts.netloc or parts.path or parts.query:
            raise _bad(url, "memory:// takes no host, path or query")
        return _StoreURL("memory")
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise _bad(url, "file URLs need an absolute path (three slashes: file:///abs/path)")
        if parts.query:
            raise _bad(url, "file:// takes no query")
        return _StoreURL("file", path=unquote(parts.path))

    try:
        port = parts.port
    except ValueError as exc:  # non-numeric or outside 0-65535
        raise _bad(url, f"port is not a number in 1-65535 ({exc})") from None
    if port is None:
        raise _bad(url, "missing port")
    if not 1 <= port <= 65535:
        raise _bad(url, f"port {port} is out of range 1-65535")
    host = parts.hostname or _DEFAULT_HOST
    if scheme == "tcp":
        if parts.path not in ("", "/") or parts.query or parts.password or parts.username:
            raise _bad(url, "tcp:// takes only host:port (TCPStore has no path, query or password)")
        return _StoreURL("tcp", host=host, port=port)

    if parts.username:
        raise _bad(url, "Redis ACL user names are not supported; write redis://:password@host:port")
    db_text = parts.path.strip("/")
    if not db_text:
        db = 0
    elif db_text.isdigit():
        db = int(db_text)
    else:
        raise _bad(url, f"the path must be a database number, got {db_text!r}")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"prefix"})
    if unknown:
        raise _bad(url, f"unknown query parameter(s) {unknown}; only 'prefix' is accepted")
    prefix = query["prefix"][-1] if "prefix" in query else None
    password = unquote(parts.password) if parts.password is not None else None
    return _StoreURL("redis", host=host, port=port, db=db, password=password, prefix=prefix)


def create_store(
    url: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    timeout: timedelta | float = DEFAULT_STORE_TIMEOUT,
    is_server: bool | None = None,
    password: str | None = None,
) -> dist.Store:
    """Build a :class:`torch.distributed.Store` from a URL.

    Forms:

    * ``memory://``: a :class:`torch.distributed.HashStore`, visible to this process only.
    * ``file:///abs/path``: a :class:`torch.distributed.FileStore` shared by ``world_size``
      processes through one file (a shared file system works; stale files from a crashed run
      must be deleted first).
    * ``tcp://host:port``: a :class:`torch.distributed.TCPStore`; ``host`` defaults to
      ``127.0.0.1`` (``tcp://:29500``). TCPStore has **no authentication**: anyone who can reach
      the port can read and write rendezvous keys, so expose it only on trusted networks.
    * ``redis://[:password@]host:port[/db][?prefix=...]``: our :class:`RedisStore`; ``db``
      defaults to 0 and ``prefix`` to :func:`~torsh_distributed.runtime.redis_store.default_prefix`.

    Args:
        url: Where the store lives (see the forms above).
        rank: This process's rank; rank 0 serves a ``tcp://`` store, and errors name it.
        world_size: Number of processes sharing the store (FileStore and TCPStore count them).
        timeout: How long ``get`` / ``wait`` block (and a TCP client tries to connect) before
            failing. Long enough for the slowest rank to start; shorter reports a dead one sooner.
        is_server: For ``tcp://``, whether this process hosts the store; default ``rank == 0``.
        password: For ``redis://``, the server's password. Prefer this to putting it in the URL,
            which tends to end up in logs and process listings.

    Returns:
        The store, ready for ``init_process_group(store=...)``.

    Raises:
        ValueError: a malformed URL (unknown scheme, missing port, relative path, port out of
            range), or a bad ``rank`` / ``world_size`` / ``timeout``.
        DistributedTimeoutError: a TCP client found no server within ``timeout``.
        CommunicationError: the TCP server could not listen, or Redis is unreachable.
    """
    spec = _parse_url(url)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise RankOutOfRangeError(
            f"rank {rank!r} is out of range for world_size {world_size}",
            rank=rank if isinstance(rank, int) else None,
            operation="create_store",
            fix="ranks run from 0 to world_size - 1.",
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise TypeError(f"timeout must be a timedelta or seconds, got {type(timeout).__name__}")
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if is_server is not None and spec.scheme != "tcp":
        raise ValueError(f"is_server only applies to tcp:// stores, not {spec.scheme}://")
    if password is not None and spec.scheme != "redis":
        raise ValueError(f"password only applies to redis:// stores, not {spec.scheme}://")

    store: dist.Store
    if spec.scheme == "memory":
        store = dist.HashStore()
        store.set_timeout(timeout)
    elif spec.scheme == "file":
        store = dist.FileStore(spec.path, world_size)
        store.set_timeout(timeout)
    elif spec.scheme == "tcp":
        server = rank == 0 if is_server is None else is_server
        store = _tcp_store(spec, url, rank, world_size, server, timeout)
    else:
        if password is not None and spec.password is not None and password != spec.password:
            raise ValueError(
                f"store URL {_redact(url)!r} and password= give different passwords; pass one"
            )
        store = RedisStore(
            spec.host,
            spec.port,
            db=spec.db,
            password=password if password is not None else spec.password,
            prefix=spec.prefix,
            timeout=timeout,
        )
    return store


def _listen(host: str, port: int, backlog: int) -> int:
    """A listening socket on ``host:port`` only (not ``*:port``), detached: its descriptor for
    TCPStore's ``master_listen_fd``, which then owns it."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(max(128, backlog))
    except OSError:
        sock.close()
        raise
    return sock.detach()


def _tcp_store(
    spec: _StoreURL, url: str, rank: int, world_size: int, server: bool, timeout: timedelta
) -> dist.TCPStore:
    fd: int | None = None
    try:
        kwargs: dict[str, object] = {}
        if server:  # TCPStore binds every interface whatever host it is given: bind ours
            fd = _listen(spec.host, spec.port, world_size)
            kwargs["master_listen_fd"] = fd
        # wait_for_workers=False: the server returns at once; init_process_group syncs later.
        return dist.TCPStore(
            spec.host,
            spec.port,
            world_size,
            server,
            timeout=timeout,
            wait_for_workers=False,
            **kwargs,  # type: ignore[arg-type]
        )
    except (dist.DistNetworkError, dist.DistStoreError, OSError) as exc:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if server:
            raise CommunicationError(
                f"cannot serve the TCP store on {spec.host}:{spec.port}: {text}",
                rank=rank,
                operation="create_store",
                fix="pick a free port (is another job or an old run still on it?) and a host "
                "name that resolves to this machine.",
            ) from exc
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise DistributedTimeoutError(
                f"no TCP store answered at {spec.host}:{spec.port} within {timeout}: {text}",
                rank=rank,
                operation="create_store",
                fix=f"start rank 0 (the server) first and check that {_redact(url)} is reachable "
                "from this host, or raise the timeout.",
            ) from exc
        raise CommunicationError(
            f"cannot reach the TCP store at {spec.host}:{spec.port}: {text}",
            rank=rank,
            operation="create_store",
            fix="check the host name and port, and that rank 0 is running.",
        ) from exc
