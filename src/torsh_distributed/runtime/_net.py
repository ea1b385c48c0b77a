"""This host's network interfaces: the one lookup every launcher and transport shares."""

from __future__ import annotations

import socket

import psutil

__all__ = ["local_addresses", "interface_of", "loopback_interface"]


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
