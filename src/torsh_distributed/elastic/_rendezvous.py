"""Rendezvous planning for :func:`torsh_distributed.elastic.launch.launch`.

One node without an endpoint: a static rendezvous whose ``TCPStore`` listens on a socket we bound
to ``master_addr`` (loopback by default). Several nodes: torch's ``static`` or ``c10d`` backends.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from torsh_distributed.elastic._network import Route
from torsh_distributed.elastic._options import LaunchOptions
from torsh_distributed.runtime.env import DEFAULT_MASTER_PORT
from torsh_distributed.runtime.errors import ConfigurationError

LOCAL_BACKEND = "torsh-local"
RDZV_TIMEOUT_S = 900

# --- rendezvous ------------------------------------------------------------------------------


class _LocalRendezvous(RendezvousHandler):
    """A one-node static rendezvous whose store listens on one socket that we bound.

    torch's static rendezvous creates ``TCPStore(master_addr, ...)``, which listens on every
    interface; this one passes ``master_listen_fd`` instead, so it listens only where we bound.
    """

    def __init__(self, *, addr: str, port: int, listener: socket.socket, run_id: str, timeout: int):
        self._addr = addr
        self._port = port
        self._listener = listener
        self._run_id = run_id
        self._timeout = timedelta(seconds=timeout)
        self._store: dist.TCPStore | None = None

    def get_backend(self) -> str:
        return LOCAL_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers reuse this store (MASTER_ADDR/PORT) instead of opening another

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is not None:
            # A restart: workers' keys (Gloo addresses, barriers) of the dead attempt
            # live in the old store, so the new attempt gets a fresh store on a fresh port, as
            # torch's own rendezvous does ("a new TCPStore for every retry").
            self._listener = _listen(self._addr, 0)
            self._port = int(self._listener.getsockname()[1])
        fd = self._listener.detach()  # the store owns and closes the descriptor from here on
        self._store = dist.TCPStore(
            self._addr, self._port, 1, True, self._timeout, master_listen_fd=fd
        )
        store = dist.PrefixStore(self._run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(self._addr, self._port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def _create_local_handler(params: RendezvousParameters) -> RendezvousHandler:
    addr, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    return _LocalRendezvous(
        addr=addr,
        port=port,
        listener=params.config["listener"],
        run_id=params.run_id,
        timeout=int(params.config.get("timeout", RDZV_TIMEOUT_S)),
    )


rendezvous_handler_registry.register(LOCAL_BACKEND, _create_local_handler)


@dataclass(slots=True)
class Plan:
    backend: str
    endpoint: str
    configs: dict[str, Any]
    listener: socket.socket | None = None
    route: Route | None = None
    """Several nodes: how this node reaches the master (set by the launcher's network check)."""


def _url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def _listen(addr: str, port: int) -> socket.socket:
    host = addr.strip("[]")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"master_addr {addr!r} does not resolve: {exc}", operation="launch"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(
            f"cannot listen on {addr}:{port} for the rendezvous store: {exc.strerror or exc}",
            operation="launch",
            fix="pick another --master-port, or leave it unset to use a free one."
            if port
            else "check that master_addr is an address of this host.",
        ) from None
    return sock


def plan(options: LaunchOptions) -> Plan:
    if options.rdzv_endpoint is not None:
        configs: dict[str, Any] = {"timeout": RDZV_TIMEOUT_S, **options.rdzv_conf}
        if options.rdzv_backend == "static":
            configs["rank"] = options.node_rank
        return Plan(options.rdzv_backend, options.rdzv_endpoint.strip(), configs)
    if options.max_nodes == 1:
        listener = _listen(options.master_addr, options.master_port or 0)
        port = int(listener.getsockname()[1])
        endpoint = f"{_url_host(options.master_addr)}:{port}"
        configs = {"rank": 0, "timeout": RDZV_TIMEOUT_S, "listener": listener}
        return Plan(LOCAL_BACKEND, endpoint, configs, listener)
    port = options.master_port or DEFAULT_MASTER_PORT
    endpoint = f"{_url_host(options.master_addr)}:{port}"
    return Plan("static", endpoint, {"rank": options.node_rank, "timeout": RDZV_TIMEOUT_S})


def is_loopback(addr: str) -> bool:
    host = addr.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
