"""Configuration of an RPC worker: who it is, where it meets its peers, and its timeouts."""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from dataclasses import dataclass, field

__all__ = ["RPCConfig", "is_loopback"]

_NAME = re.compile(r"^[A-Za-z0-9_:\-]{1,127}$")  # torch.distributed.rpc's own rule


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address, a host name or an interface name) is this machine only."""
    if host in ("lo", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


@dataclass(kw_only=True, slots=True)
class RPCConfig:
    """One worker's RPC settings, validated at construction.

    Rendezvous goes through ``store_url`` (any :func:`~torsh_distributed.runtime.create_store`
    form but ``memory://`` beyond one worker), else through a TCP store that rank 0 serves on
    ``master_addr:master_port``.
    """

    name: str
    """This worker's unique name (letters, digits, ``_ : -``; < 128 characters); peers call it by it."""
    rank: int
    """This worker's unique rank in ``[0, world_size)``; rank 0 serves a ``tcp://`` store."""
    world_size: int
    """Number of workers; :func:`init` returns once all of them joined (a static group)."""
    store_url: str | None = None
    """Rendezvous store URL (``tcp://``, ``file://``, ``redis://``). ``None``: a TCP store on
    ``master_addr:master_port``. Redis suits a store that must outlive the workers."""
    master_addr: str = "127.0.0.1"
    """Host of the TCP store when ``store_url`` is ``None``; rank 0 listens on this address only."""
    master_port: int | None = None
    """Port of the TCP store when ``store_url`` is ``None`` (required then)."""
    interface: str = "lo"
    """Network interface TensorPipe listens on (``TP_SOCKET_IFNAME``). ``"lo"`` keeps the worker
    reachable from this machine only; name a real interface (``"eth0"``) for multi-host jobs.
    TensorPipe reads it once per process, so every :func:`init` of a process must agree."""
    timeout: float = 60.0
    """Default timeout (seconds) of every call and of ``to_here``; each call may override it."""
    rendezvous_timeout: float = 120.0
    """How long (seconds) :func:`init` waits for the store and for every peer to join."""
    shutdown_timeout: float = 30.0
    """How long (seconds) a graceful :func:`shutdown` waits for the peers before shutting down
    locally. Longer lets slow peers drain their calls; shorter ends sooner when one is dead."""
    token: str | None = field(default=None, repr=False)
    """Shared secret every worker must present at rendezvous; required when the interface or
    the store is not loopback. It keeps a worker of another job (or a misconfigured one) out of
    the group; it does not encrypt or authenticate the TensorPipe traffic itself."""
    num_worker_threads: int = 16
    """Threads serving incoming calls. A call that blocks holds one until it returns, even after
    its caller timed out; more threads tolerate more blocked calls."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"name must be 1-127 letters, digits, '_', ':' or '-', got {self.name!r}"
            )
        for key in ("rank", "world_size", "num_worker_threads"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{key} must be an int, got {type(value).__name__}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {self.num_worker_threads}")
        self.timeout = _positive("timeout", self.timeout)
        self.rendezvous_timeout = _positive("rendezvous_timeout", self.rendezvous_timeout)
        self.shutdown_timeout = _positive("shutdown_timeout", self.shutdown_timeout)
        if self.store_url is None:
            if self.master_port is None:
                raise ValueError("pass store_url or master_port (the TCP store's port)")
            if isinstance(self.master_port, bool) or not isinstance(self.master_port, int):
                raise TypeError(
                    f"master_port must be an int, got {type(self.master_port).__name__}"
                )
            if not 1 <= self.master_port <= 65535:
                raise ValueError(f"master_port must be in 1-65535, got {self.master_port}")
        elif not isinstance(self.store_url, str):
            raise TypeError(f"store_url must be a str, got {type(self.store_url).__name__}")
        elif self.store_url.startswith("memory:") and self.world_size > 1:
            raise ValueError(
                "store_url 'memory://' is visible to one process only; use world_size=1"
            )
        if not isinstance(self.interface, str) or not self.interface:
            raise ValueError(f"interface must be a network interface name, got {self.interface!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("token must be a non-empty str (or None on loopback)")
        if self.exposed and self.token is None:
            raise ValueError(
                f"token is required when the worker is reachable from other hosts "
                f"(interface={self.interface!r}, store={self.store_host!r}); pass the same "
                f"token= to every worker"
            )

    @property
    def store_host(self) -> str:
        """Host of the rendezvous store (``""`` for a file store)."""
        if self.store_url is None:
            return self.master_addr
        from urllib.parse import urlsplit

        parts = urlsplit(self.store_url)
        if parts.scheme in ("file", "memory"):
            return ""
        return parts.hostname or "127.0.0.1"

    @property
    def exposed(self) -> bool:
        """True when the TensorPipe interface or the store is reachable beyond this machine."""
        host = self.store_host
        return not is_loopback(self.interface) or (host != "" and not is_loopback(host))
