"""Read network interfaces and InfiniBand/RoCE ports from a sysfs tree.

The root is ``/`` on a live host and a recorded copy in tests (only the files read here need to
exist). Nothing is written and nothing needs root. Files read, relative to the root:

* ``sys/class/net/IF/{operstate,speed,type}``, ``sys/class/net/IF/device`` (present for a PCI
  device, absent for ``lo``, bridges, veth pairs, bonds), ``sys/class/net/IF/device/numa_node``,
  ``sys/class/net/IF/bonding/`` (a bond);
* ``sys/class/infiniband/DEV/ports/N/{state,link_layer,rate}``,
  ``sys/class/infiniband/DEV/device/numa_node``, ``sys/class/infiniband/DEV/device/net/IF`` (the
  net device of a RoCE port, or the IPoIB interface of an InfiniBand one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HcaPort", "NetInterface", "read_hca_ports", "read_interfaces"]

_CONTAINER = re.compile(r"^(docker|veth|virbr|br-|cni|flannel|cali|vxlan|tun|tap|kube|lxc|podman)")
"""Name prefixes of the virtual interfaces container runtimes and hypervisors create."""

ARPHRD_ETHER, ARPHRD_INFINIBAND, ARPHRD_LOOPBACK = 1, 32, 772
"""``/sys/class/net/IF/type`` values (linux/if_arp.h)."""


@dataclass(frozen=True, slots=True)
class NetInterface:
    """One entry of ``/sys/class/net``."""

    name: str
    operstate: str
    """``up``, ``down``, ``unknown`` (loopback and some virtual devices), ``dormant`` ..."""
    speed_mbps: int | None
    """Link speed in Mb/s; None when the kernel reports none (down link, virtual device)."""
    kind: str
    """``physical`` (a PCI device), ``bond``, ``loopback``, ``container`` (docker0, veth...,
    virbr0...) or ``virtual`` (anything else without a device: bridges, VLANs, tunnels)."""
    link_type: int | None
    """ARPHRD type: 1 Ethernet, 32 IPoIB, 772 loopback."""
    numa_node: int | None
    """NUMA node of the PCI device; None when virtual or unknown (-1)."""
    hca: str | None = None
    """The InfiniBand/RoCE device this interface belongs to (``mlx5_0``), if any."""

    @property
    def is_ipoib(self) -> bool:
        """Whether this is IP over InfiniBand (``ib0``)."""
        return self.link_type == ARPHRD_INFINIBAND


@dataclass(frozen=True, slots=True)
class HcaPort:
    """One port of an InfiniBand or RoCE device (``/sys/class/infiniband/DEV/ports/N``)."""

    device: str
    port: int
    state: str
    """``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED`` (the word after ``4: `` in the state file)."""
    link_layer: str
    """``InfiniBand`` or ``Ethernet`` (RoCE)."""
    rate_gbps: float | None
    """Signalling rate in Gb/s (``400 Gb/sec (4X NDR)`` -> 400.0)."""
    numa_node: int | None
    netdevs: tuple[str, ...] = ()
    """Net devices of this HCA (the RoCE interface, or the IPoIB one)."""

    @property
    def name(self) -> str:
        """``DEV:PORT`` as NCCL_IB_HCA spells it."""
        return f"{self.device}:{self.port}"

    @property
    def active(self) -> bool:
        """Whether the port can carry traffic."""
        return self.state == "ACTIVE"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # absent, or EINVAL (speed of a down link)
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _numa(path: Path) -> int | None:
    value = _int(_read(path))
    return value if value is not None and value >= 0 else None


def _sorted_names(directory: Path) -> list[str]:
    """Entries of ``directory`` in natural order (mlx5_2 before mlx5_10); [] if absent."""
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return []
    return sorted(names, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])


def read_hca_ports(root: str | Path = "/") -> list[HcaPort]:
    """Every port of every device under ``ROOT/sys/class/infiniband``, in natural order."""
    base = Path(root) / "sys" / "class" / "infiniband"
    ports: list[HcaPort] = []
    for device in _sorted_names(base):
        dev_dir = base / device
        numa = _numa(dev_dir / "device" / "numa_node")
        netdevs = tuple(_sorted_names(dev_dir / "device" / "net"))
        for port in _sorted_names(dev_dir / "ports"):
            port_dir = dev_dir / "ports" / port
            state = (_read(port_dir / "state") or "UNKNOWN").split(":")[-1].strip()
            rate_text = _read(port_dir / "rate") or ""
            rate = re.match(r"^\s*([\d.]+)\s*Gb/sec", rate_text)
            ports.append(
                HcaPort(
                    device=device,
                    port=int(port) if port.isdigit() else 1,
                    state=state,
                    link_layer=_read(port_dir / "link_layer") or "InfiniBand",
                    rate_gbps=float(rate.group(1)) if rate else None,
                    numa_node=numa,
                    netdevs=netdevs,
                )
            )
    return ports


def _kind(name: str, directory: Path, link_type: int | None) -> str:
    if link_type == ARPHRD_LOOPBACK or name in ("lo", "lo0"):
        return "loopback"
    if (directory / "bonding").is_dir():
        return "bond"
    if _CONTAINER.match(name):
        return "container"
    if (directory / "device").exists():
        return "physical"
    return "virtual"


def read_interfaces(root: str | Path = "/", *, hca_ports: list[HcaPort] | None = None) -> list[NetInterface]:
    """Every interface under ``ROOT/sys/class/net`` in natural order, with its HCA if any."""
    base = Path(root) / "sys" / "class" / "net"
    owner = {dev: port.device for port in (hca_ports or []) for dev in port.netdevs}
    interfaces: list[NetInterface] = []
    for name in _sorted_names(base):
        directory = base / name
        if not directory.is_dir():
            continue  # bonding_masters and other plain files
        link_type = _int(_read(directory / "type"))
        kind = _kind(name, directory, link_type)
        speed = _int(_read(directory / "speed"))
        interfaces.append(
            NetInterface(
                name=name,
                operstate=(_read(directory / "operstate") or "unknown").lower(),
                speed_mbps=speed if speed is not None and speed > 0 else None,
                kind=kind,
                link_type=link_type,
                numa_node=_numa(directory / "device" / "numa_node") if kind == "physical" else None,
                hca=owner.get(name),
            )
        )
    return interfaces
