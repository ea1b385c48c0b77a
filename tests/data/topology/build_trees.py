"""Write the recorded sysfs trees (``*/root/sys/class/...``) of the machines in this directory.

Run once by hand (``python tests/data/topology/build_trees.py``); the trees are committed. Each
machine's ``SOURCE.md`` says which values come from its public source and which are constructed
to match it; the comments below say the same per value. Only the files that
``torsh_distributed.runtime._sysfs`` reads are written.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Hca:
    name: str
    state: str  # the kernel's "4: ACTIVE" / "1: DOWN"
    link_layer: str
    rate: str | None
    numa: int
    netdevs: list[str] = field(default_factory=list)


@dataclass
class Net:
    name: str
    operstate: str
    speed: int | None  # Mb/s; None: no speed file content (virtual, or down)
    link_type: int = 1  # 1 Ethernet, 32 IPoIB, 772 loopback
    numa: int | None = None  # None: no device/ (virtual)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def build(machine: str, hcas: list[Hca], nets: list[Net]) -> None:
    root = HERE / machine / "root"
    shutil.rmtree(root, ignore_errors=True)
    for hca in hcas:
        base = root / "sys" / "class" / "infiniband" / hca.name
        _write(base / "ports" / "1" / "state", hca.state)
        _write(base / "ports" / "1" / "link_layer", hca.link_layer)
        if hca.rate is not None:
            _write(base / "ports" / "1" / "rate", hca.rate)
        _write(base / "device" / "numa_node", str(hca.numa))
        for dev in hca.netdevs:
            (base / "device" / "net" / dev).mkdir(parents=True)
    for net in nets:
        base = root / "sys" / "class" / "net" / net.name
        _write(base / "operstate", net.operstate)
        _write(base / "type", str(net.link_type))
        _write(base / "speed", str(net.speed if net.speed is not None else -1))
        if net.numa is not None:
            _write(base / "device" / "numa_node", str(net.numa))


def common(extra: list[Net]) -> list[Net]:
    """lo, a Docker bridge and one veth: on every constructed host, to be excluded."""
    return [
        Net("lo", "unknown", None, link_type=772),
        Net("docker0", "down", None),
        Net("veth3f2a1c0", "up", 10000),
        *extra,
    ]


def h100() -> None:
    """8x H100 SXM, 8 NDR InfiniBand HCAs (one per GPU, PIX) + 5 Ethernet HCAs (Penny blog)."""
    ib = [
        # names and NUMA (NIC0-3 near GPU0-3 on node 0, NIC4-7 near GPU4-7 on node 1): transcribed
        # from topo.txt; rate transcribed for mlx5_ib0 (ibstatus), assumed equal for ib1-7;
        # ACTIVE and the IPoIB netdevs ibN: constructed.
        Hca(f"mlx5_ib{i}", "4: ACTIVE", "InfiniBand", "400 Gb/sec (4X NDR)", 0 if i < 4 else 1, [f"ib{i}"])
        for i in range(8)
    ]
    eth = [
        # link layer Ethernet and 25 Gb/s transcribed for mlx5_eth4 (ibstatus), assumed for
        # eth0-3; NUMA 1 from topo.txt (NODE to GPU4-7); ACTIVE and netdev names: constructed.
        Hca(f"mlx5_eth{i}", "4: ACTIVE", "Ethernet", "25 Gb/sec (1X EDR)", 1, [f"eth{i}"])
        for i in range(5)
    ]
    nets = [Net(f"ib{i}", "up", None, link_type=32, numa=0 if i < 4 else 1) for i in range(8)]
    nets += [Net(f"eth{i}", "up", 25000, numa=1) for i in range(5)]
    build("h100-sxm-8gpu-ndr", ib + eth, common(nets))


def a100() -> None:
    """8x A100-SXM4-40GB (DGX A100 layout), 8 compute HCAs in PXB pairs + 2 storage ports."""
    numa = [3, 3, 1, 1, 7, 7, 5, 5]  # from topo.txt: the NUMA affinity of the GPUs each pair serves
    hcas = [
        # "IB Connet-X 5" per the source: EDR 100 Gb/s; ACTIVE and the IPoIB names: constructed.
        Hca(f"mlx5_{i}", "4: ACTIVE", "InfiniBand", "100 Gb/sec (4X EDR)", numa[i], [f"ib{i}"])
        for i in range(8)
    ]
    # mlx5_8/9: one dual-port card, SYS from every GPU (topo.txt): the storage/in-band NIC of the
    # DGX A100 layout. Link layer, rate, state, NUMA and netdev names: constructed.
    hcas += [
        Hca("mlx5_8", "4: ACTIVE", "Ethernet", "100 Gb/sec (4X EDR)", 0, ["enp225s0f0"]),
        Hca("mlx5_9", "4: ACTIVE", "Ethernet", "100 Gb/sec (4X EDR)", 0, ["enp225s0f1"]),
    ]
    nets = [Net(f"ib{i}", "up", None, link_type=32, numa=numa[i]) for i in range(8)]
    nets += [Net("enp225s0f0", "up", 100000, numa=0), Net("enp225s0f1", "up", 100000, numa=0)]
    build("a100-sxm-8gpu-dgx-layout", hcas, common(nets))


def rtx6000ada() -> None:
    """ASUS ESC8000A-E12: 4x RTX 6000 Ada (PCIe), 2x ConnectX-7 dual-port RoCE (all ports down)."""
    hcas = [
        # link_layer Ethernet and PORT_DOWN: transcribed (ibv_devinfo); NUMA: transcribed (lspci:
        # 21:00.x on node 0, 81:00.x on node 1); netdev names: constructed from the PCI addresses
        # by systemd's naming scheme. No rate file (not in the source).
        Hca("mlx5_0", "1: DOWN", "Ethernet", None, 0, ["enp33s0f0np0"]),
        Hca("mlx5_1", "1: DOWN", "Ethernet", None, 0, ["enp33s0f1np1"]),
        Hca("mlx5_2", "1: DOWN", "Ethernet", None, 1, ["enp129s0f0np0"]),
        Hca("mlx5_3", "1: DOWN", "Ethernet", None, 1, ["enp129s0f1np1"]),
    ]
    nets = [Net(dev, "down", None, numa=h.numa) for h in hcas for dev in h.netdevs]
    # Intel X710 10GBASE-T at 82:00.0/.1, root complex 0000:80 (node 1): transcribed (lspci);
    # names constructed; port 0 up at 10 Gb/s (someone ssh'd in) and port 1 down: constructed.
    nets += [Net("enp130s0f0", "up", 10000, numa=1), Net("enp130s0f1", "down", None, numa=1)]
    build("rtx6000ada-pcie-4gpu-roce", hcas, common(nets))


if __name__ == "__main__":
    h100()
    a100()
    rtx6000ada()
