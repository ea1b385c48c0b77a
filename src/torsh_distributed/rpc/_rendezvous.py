"""Rendezvous for the RPC agent: a store from our URLs, a token check, and torch's public hook.

``torch.distributed.rpc.init_rpc`` takes no store object, only ``init_method`` (a URL it hands to
``torch.distributed.rendezvous``). The public way to give it any store, including our
:class:`~torsh_distributed.runtime.RedisStore`, is ``register_rendezvous_handler``: we register
the scheme ``torsh-rpc://<id>`` once, park the store under ``<id>`` and let the handler yield it.

A ``tcp://`` store served by rank 0 is bound to the URL's host only: torch's ``TCPStore`` binds
every interface (``*:port``) whatever host it is given, so we bind the listening socket ourselves
and hand it over with ``master_listen_fd``.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from hashlib import sha256
from urllib.parse import urlsplit

import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler

from torsh_distributed.rpc.config import RPCConfig
from torsh_distributed.runtime.errors import (
    CommunicationError,
    ConfigurationError,
    DistributedTimeoutError,
)
from torsh_distributed.runtime.stores import create_store

SCHEME = "torsh-rpc"
_AUTH_PREFIX = "torsh-rpc/auth/"

_lock = threading.Lock()
_parked: dict[str, tuple[dist.Store, int, int]] = {}
_registered = False


def _handler(url: str, **_: object) -> Iterator[tuple[dist.Store, int, int]]:
    key = urlsplit(url).netloc
    with _lock:
        entry = _parked.pop(key, None)
    if entry is None:
        raise ValueError(f"{SCHEME}:// URLs are made by torsh_distributed.rpc.init only ({url!r})")
    yield entry


def init_method_for(store: dist.Store, rank: int, world_size: int) -> str:
    """An ``init_method`` URL that makes ``init_rpc`` rendezvous through ``store``."""
    global _registered
    with _lock:
        if not _registered:
            register_rendezvous_handler(SCHEME, _handler)
            _registered = True
        key = secrets.token_hex(8)
        _parked[key] = (store, rank, world_size)
    return f"{SCHEME}://{key}"


def store_url(config: RPCConfig) -> str:
    """The rendezvous URL of ``config``: ``store_url`` or the TCP store on the master."""
    if config.store_url is not None:
        return config.store_url
    host = config.master_addr
    return (
        f"tcp://[{host}]:{config.master_port}"
        if ":" in host
        else f"tcp://{host}:{config.master_port}"
    )


def open_store(config: RPCConfig) -> tuple[dist.Store, socket.socket | None]:
    """Connect to (rank 0 of a ``tcp://`` URL: serve) the rendezvous store.

    Returns:
        The store and, on the TCP server, its listening socket (close it after the agent).
    """
    url = store_url(config)
    timeout = timedelta(seconds=config.rendezvous_timeout)
    parts = urlsplit(url)
    if parts.scheme != "tcp" or config.rank != 0:
        kwargs: dict[str, object] = {"is_server": False} if parts.scheme == "tcp" else {}
        return create_store(
            url, rank=config.rank, world_size=config.world_size, timeout=timeout, **kwargs
        ), None
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 0
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, config.world_size))
        store = dist.TCPStore(
            host,
            port,
            config.world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except (OSError, RuntimeError) as exc:
        sock.close()
        raise CommunicationError(
            f"cannot serve the RPC store on {host}:{port}: {exc}",
            rank=config.rank,
            operation="rpc.init",
            fix="pick a free port and an address of this machine for master_addr.",
        ) from exc
    return store, sock


def _mac(token: str | None, nonce: str, rank: int, name: str) -> str:
    if token is None:
        return "-"
    return hmac.new(token.encode(), f"{nonce}|{rank}|{name}".encode(), sha256).hexdigest()


def check_token(store: dist.Store, config: RPCConfig) -> None:
    """Every worker proves it holds the same token (or that none has one) before the agent starts.

    Each rank writes ``nonce|name|HMAC-SHA256(token, nonce|rank|name)`` and checks every peer's
    entry. This also is where workers wait for late peers, bounded by ``rendezvous_timeout``.

    Raises:
        ConfigurationError: a peer holds another token (or none while this worker has one).
        DistributedTimeoutError: some ranks did not join within ``rendezvous_timeout``.
    """
    nonce = secrets.token_hex(16)
    mine = f"{nonce}|{config.name}|{_mac(config.token, nonce, config.rank, config.name)}"
    store.set(f"{_AUTH_PREFIX}{config.rank}", mine)
    keys = [f"{_AUTH_PREFIX}{r}" for r in range(config.world_size)]
    try:
        store.wait(keys, timedelta(seconds=config.rendezvous_timeout))
    except (RuntimeError, dist.DistStoreError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, dist.DistNetworkError) or "timeout" not in text.lower():
            raise CommunicationError(
                f"lost the rendezvous store while waiting for the RPC workers: {text}",
                rank=config.rank,
                operation="rpc.init",
                fix="the store's host (rank 0 for tcp://) stopped: see its log for why.",
            ) from exc
        missing = [r for r, key in enumerate(keys) if not _has(store, key)]
        raise DistributedTimeoutError(
            f"RPC workers of ranks {missing or '?'} did not join within "
            f"{config.rendezvous_timeout:.0f} s",
            rank=config.rank,
            operation="rpc.init",
            fix="start every worker with the same store and world_size, or raise rendezvous_timeout.",
        ) from exc
    for rank, key in enumerate(keys):
        if rank == config.rank:
            continue
        nonce_r, name_r, mac_r = store.get(key).decode().split("|", 2)
        expected = _mac(config.token, nonce_r, rank, name_r)
        if not hmac.compare_digest(expected, mac_r):
            raise ConfigurationError(
                f"RPC worker {name_r!r} (rank {rank}) presented a different token",
                rank=config.rank,
                operation="rpc.init",
                fix="pass the same token= to every worker of the job (or none to all on loopback).",
            )


def _has(store: dist.Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except (RuntimeError, dist.DistStoreError):
        return False
