"""Networking checks for multi-node launches: which interface leads to the master, whether this
node hosts the rendezvous store, and whether the master can be reached at all.

Why. Gloo picks the address it advertises to its peers by resolving this host's name. On many
machines (containers, cloud images, ``/etc/hosts`` written by installers) the name resolves to
``127.0.0.1``/``127.0.1.1``: every rank then tells the others to connect to loopback and the job
dies with "connection refused". The interface that routes to the master is the one the other
nodes can reach us on, so :func:`route_to` finds it (a UDP ``connect`` sends nothing; the kernel
only picks the route) and the launcher hands its name to Gloo as ``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from torsh_distributed.runtime._net import local_addresses
from torsh_distributed.runtime.errors import ConfigurationError, ProcessFailureError

__all__ = [
    "Route",
    "route_to",
    "hostname_is_loopback",
    "is_local",
    "port_is_free",
    "wait_for_master",
]

_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN}


@dataclass(frozen=True, slots=True)
class Route:
    """How this node reaches the master."""

    interface: str
    """Name of the local interface the kernel routes the master's traffic through (``eth0``)."""
    local_ip: str
    """This node's address on that interface: what peers must connect to."""
    master_ip: str
    """The master's address, resolved."""


def _resolve(host: str, port: int) -> tuple[int, tuple]:
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"the master address {host!r} does not resolve on this node: {exc.strerror or exc}",
            operation="launch",
            fix="pass an IP address or a name every node resolves (--master-addr / "
            "--rdzv-endpoint).",
        ) from None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def route_to(host: str, port: int) -> Route:
    """The interface and local address this node uses to reach ``host:port``.

    Raises:
        ConfigurationError: ``host`` does not resolve, or there is no route to it (naming both).
    """
    family, sockaddr = _resolve(host, port)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr)  # UDP: chooses the route, sends nothing
        except OSError as exc:
            raise ConfigurationError(
                f"no route from this node to the master {sockaddr[0]} ({host}): "
                f"{exc.strerror or exc}",
                operation="launch",
                fix="check --master-addr / --rdzv-endpoint and this node's network "
                "configuration (ip route).",
            ) from None
        local_ip = probe.getsockname()[0]
    interface = local_addresses().get(local_ip)
    if interface is None:
        raise ConfigurationError(
            f"the route to the master {sockaddr[0]} leaves from {local_ip}, which no interface "
            "of this node holds",
            operation="launch",
            fix="set GLOO_SOCKET_IFNAME to the interface the nodes share.",
        )
    return Route(interface=interface, local_ip=local_ip, master_ip=sockaddr[0])


def hostname_is_loopback() -> bool:
    """True when this host's name resolves to a loopback address (or does not resolve)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return True
    return all(ipaddress.ip_address(info[4][0].split("%", 1)[0]).is_loopback for info in infos)


def is_local(ip: str) -> bool:
    """True when ``ip`` is an address of this machine (loopback included)."""
    return ipaddress.ip_address(ip).is_loopback or ip in local_addresses()


def port_is_free(ip: str, port: int) -> bool:
    """True when a listening socket can be bound to ``ip:port`` right now."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


def wait_for_master(
    route: Route,
    port: int,
    *,
    unreachable_after_s: float,
    give_up_after_s: float,
    on_wait: Callable[[float], None] | None = None,
) -> None:
    """Block until something listens on the master's ``port``; fail fast when it is unreachable.

    "Connection refused" means the master's host answers but its store is not up yet (node 0
    started later): keep waiting, up to ``give_up_after_s``. No answer at all (timeout, no route
    to host) for ``unreachable_after_s`` means the address is wrong or a firewall drops the
    traffic: fail then, naming the address and the interface we tried from.

    Args:
        route: From :func:`route_to`.
        port: The store's port.
        unreachable_after_s: Seconds of silence after which the master counts as unreachable.
        give_up_after_s: Seconds of "connection refused" after which to give up (the rendezvous
            timeout).
        on_wait: Called with the seconds waited so far, about every 10 s while the master's
            host refuses (to tell the user what we wait for).

    Raises:
        ProcessFailureError: the master did not answer or never started listening.
    """
    family = socket.AF_INET6 if ":" in route.master_ip else socket.AF_INET
    start = time.monotonic()
    silent_since: float | None = None
    last_note = start
    while True:
        now = time.monotonic()
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(min(2.0, max(0.2, unreachable_after_s / 3)))
            try:
                sock.connect((route.master_ip, port))
                return
            except ConnectionRefusedError:
                silent_since = None
                state = "refused"
            except OSError as exc:  # socket.timeout is an OSError too
                if isinstance(exc, TimeoutError) or exc.errno in _UNREACHABLE:
                    silent_since = now if silent_since is None else silent_since
                    state = "silent"
                else:
                    raise
        now = time.monotonic()
        if state == "silent" and silent_since is not None:
            if now - silent_since >= unreachable_after_s:
                raise ProcessFailureError(
                    f"cannot reach the master {route.master_ip}:{port} from this node "
                    f"({route.interface}, {route.local_ip}): no answer for "
                    f"{now - silent_since:.0f} s",
                    operation="rendezvous",
                    fix="check --master-addr / --rdzv-endpoint (the address of node 0, "
                    "reachable from every node) and that no firewall drops the port.",
                )
        elif now - start >= give_up_after_s:
            raise ProcessFailureError(
                f"nothing listens on the master {route.master_ip}:{port} after "
                f"{now - start:.0f} s (the host answers, the port is closed)",
                operation="rendezvous",
                fix="start node 0 (it runs the store), and check the port every node was given.",
            )
        if on_wait is not None and state == "refused" and now - last_note >= 10:
            last_note = now
            on_wait(now - start)
        time.sleep(0.25)  # poll interval while the master's store is not up yet
