"""This host's network interfaces and free ports: the one lookup every launcher and transport
shares."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

import psutil

__all__ = ["free_port", "local_addresses", "interface_of", "loopback_interface"]


def local_addresses() -> dict[str, str]:
    """Every IP address of this machine (current network namespace) -> its interface name."""
    out: dict[str, str] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6):
                out[addr.address.split("%", 1)[0]] = name
    return out


def interface_of(address: str) -> str | None:
    """The name of the interface holding ``address`` (``"lo"`` for 127.0.0.1), if any."""
    return local_addresses().get(address.split("%", 1)[0])


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on BSD/macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, for a server started next.

    Drawn at random (from the OS's entropy: a caller that seeds :mod:`random` must not make two
    processes draw alike) outside the kernel's ephemeral range, from which every outgoing
    connection (Gloo's, a store client's, a browser's) takes its local port: a port probed free
    there can be handed to a connection on a busy host before the server binds it. Falls back
    to a kernel-chosen port. Where the caller can keep the socket it should bind port 0 itself.
    """
    for low, high in _unassigned_ranges():
        for _ in range(32):
            port = low + secrets.randbelow(high - low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _unassigned_ranges() -> list[tuple[int, int]]:
    """Port ranges ``[low, high)`` outside the kernel's ephemeral range, the larger first."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        first, last = int(text[0]), int(text[1])
    except (OSError, ValueError, IndexError):
        return []
    ranges = [(max(first - 8192, 1024), first), (last + 1, 65536)]
    return sorted((r for r in ranges if r[1] - r[0] >= 1024), key=lambda r: r[0] - r[1])
