"""This host's GPU interconnect, NICs and the NCCL/Gloo launch environment they call for.

:func:`diagnose` reads a sysfs tree (``/`` or a recorded copy) and, when there is one, the output
of ``nvidia-smi topo -m``, and returns a :class:`DoctorReport`: each setting
(``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``, ``NCCL_IB_HCA``, ``NCCL_IB_DISABLE``) with a
one-line reason, each local rank's GPU, nearest NIC and NUMA node, and notes on NVLink and PCIe
distances. ``torsh-dist doctor`` prints it; nothing here imports torch or changes the host.

The launcher does not apply these settings yet: export them (``torsh-dist doctor --env``) or pass
them to your scheduler. Tested on recorded machines (tests/data/topology), not on IB hardware.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torsh_distributed.runtime._nccl_env import (
    choose_hcas,
    choose_socket_interfaces,
    exact_list,
    gpu_rails,
    link_notes,
)
from torsh_distributed.runtime._sysfs import HcaPort, NetInterface, read_hca_ports, read_interfaces
from torsh_distributed.runtime._topo_parse import (
    TopoMatrix,
    TopoParseError,
    parse_topo,
    read_topo,
)

__all__ = [
    "DoctorReport",
    "GpuPlacement",
    "Setting",
    "TopoMatrix",
    "TopoParseError",
    "diagnose",
    "format_env",
    "format_report",
    "load_topology",
    "parse_topo",
    "read_topo",
]


@dataclass(frozen=True, slots=True)
class Setting:
    """One environment variable: the value to export (None: leave unset) and why."""

    name: str
    value: str | None
    reason: str
    current: str | None = None
    """What this process's environment has now (None: unset)."""


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    """Where local rank ``local_rank`` (GPU ``gpu``) should send and run."""

    local_rank: int
    gpu: str
    nic: str | None
    """Nearest NIC (an HCA device name), None when the topology lists no NIC."""
    link: str | None
    """PCI distance to it (``PIX`` ... ``SYS``)."""
    nic_state: str | None
    """State of the NIC's first port in sysfs (``ACTIVE``, ``DOWN``); None if sysfs lacks it."""
    numa_node: int | None
    cpus: str | None


@dataclass(frozen=True, slots=True)
class DoctorReport:
    """Everything ``torsh-dist doctor`` found and decided (see :func:`diagnose`)."""

    sysfs_root: str
    topo_source: str | None
    gpus: tuple[str, ...]
    interfaces: tuple[NetInterface, ...]
    hca_ports: tuple[HcaPort, ...]
    settings: tuple[Setting, ...]
    placements: tuple[GpuPlacement, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def setting(self, name: str) -> Setting:
        """The setting called ``name`` (``KeyError`` if the report has none)."""
        for item in self.settings:
            if item.name == name:
                return item
        raise KeyError(name)

    def env(self) -> dict[str, str]:
        """The variables to export: every setting with a value."""
        return {s.name: s.value for s in self.settings if s.value is not None}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (``torsh-dist doctor --json``)."""
        return {
            "sysfs_root": self.sysfs_root,
            "topology": self.topo_source,
            "gpus": list(self.gpus),
            "env": self.env(),
            "settings": [asdict(s) for s in self.settings],
            "placements": [asdict(p) for p in self.placements],
            "interfaces": [asdict(i) for i in self.interfaces],
            "hca_ports": [{**asdict(p), "name": p.name} for p in self.hca_ports],
            "notes": list(self.notes),
        }


def load_topology(path: str | Path | None, *, live: bool) -> tuple[TopoMatrix | None, str]:
    """The topology from ``path``, else (on a live host) from ``nvidia-smi topo -m``.

    Returns the matrix (None when there is none) and a line saying where it came from or why
    there is none. A recorded sysfs tree never gets the live host's ``nvidia-smi``: the two
    would describe different machines.
    """
    if path is not None:
        return read_topo(path), f"topology from {path}"
    if not live:
        return None, "no --topo file given for the recorded sysfs tree: GPUs unknown"
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "no GPUs found (nvidia-smi is not on PATH)"
    try:
        proc = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"no GPUs found (nvidia-smi topo -m failed: {exc})"
    if proc.returncode != 0:
        first = (proc.stderr or proc.stdout).strip().splitlines()[:1]
        return None, f"no GPUs found (nvidia-smi topo -m: {first[0] if first else proc.returncode})"
    return parse_topo(proc.stdout, source="nvidia-smi topo -m"), "topology from nvidia-smi topo -m"


def diagnose(
    *, sysfs_root: str | Path = "/", topo: TopoMatrix | None = None,
    environ: Mapping[str, str] | None = None, topo_note: str | None = None,
) -> DoctorReport:
    """Decide the NCCL/Gloo launch environment of the machine ``sysfs_root`` and ``topo`` describe.

    Args:
        sysfs_root: Root of the sysfs tree to read (``/`` here; a recorded tree in tests).
        topo: The parsed ``nvidia-smi topo -m`` of the same machine, or None (no GPUs known):
            without it the HCAs are every active port and there are no placements.
        environ: The environment to compare against (default ``os.environ``): each setting
            carries the value it has now, so a report shows what an export would change.
        topo_note: A line on where the topology came from, kept first among the notes.
    """
    environ = os.environ if environ is None else environ
    ports = read_hca_ports(sysfs_root)
    interfaces = read_interfaces(sysfs_root, hca_ports=ports)
    names = [i.name for i in interfaces]
    notes: list[str] = [topo_note] if topo_note else []

    chosen, socket_reason = choose_socket_interfaces(interfaces)
    socket_value = exact_list(chosen, names) if chosen else None
    gloo_value = chosen[0] if chosen else None
    if len(chosen) > 1:
        gloo_reason = (f"{chosen[0]}: the first of NCCL_SOCKET_IFNAME's; one only, since Gloo "
                       "stripes over every listed interface and all ranks must share one network")
    else:
        gloo_reason = f"{chosen[0]}: as NCCL_SOCKET_IFNAME" if chosen else socket_reason
    hcas, hca_reason = choose_hcas(ports, topo)
    devices = sorted({p.device for p in ports})
    hca_value = exact_list([p.name for p in hcas], devices) if hcas else None
    disable_value = None if hcas else "1"
    disable_reason = (
        "IB/RoCE ports in NCCL_IB_HCA are active: NCCL's IB transport carries inter-node traffic"
        if hcas else
        f"{hca_reason}: inter-node traffic goes over sockets (NCCL_SOCKET_IFNAME); this skips the "
        "IB probe and makes the choice explicit"
    )
    if not chosen:
        socket_reason += ": a multi-host job has no network here (single-host jobs use loopback)"
    settings = [
        Setting("NCCL_SOCKET_IFNAME", socket_value, socket_reason),
        Setting("GLOO_SOCKET_IFNAME", gloo_value, gloo_reason),
        Setting("NCCL_IB_HCA", hca_value, hca_reason),
        Setting("NCCL_IB_DISABLE", disable_value, disable_reason),
    ]
    settings = [
        Setting(s.name, s.value, s.reason, environ.get(s.name)) for s in settings
    ]

    placements: list[GpuPlacement] = []
    gpus: tuple[str, ...] = ()
    if topo is not None and topo.gpus:
        gpus = topo.gpus
        first_port: dict[str, str] = {}
        for port in ports:
            first_port.setdefault(port.device, port.state)
        for rank, (gpu, nic, link) in enumerate(gpu_rails(topo, ports)):
            placements.append(GpuPlacement(
                local_rank=rank, gpu=gpu, nic=nic, link=link,
                nic_state=first_port.get(nic) if nic else None,
                numa_node=topo.numa_node.get(gpu), cpus=topo.cpu_affinity.get(gpu),
            ))
        notes += _placement_notes(placements)
        notes += link_notes(topo)
    if not gpus and topo is not None:
        notes.append("the topology lists no GPU")
    if not gpus:
        notes.append("NCCL settings apply when this host runs GPU ranks; Gloo's apply to CPU ranks")
    if any(p.link_layer == "Ethernet" for p in hcas):
        notes.append("RoCE: NCCL 2.21+ picks the RoCE v2 GID itself; older releases need "
                     "NCCL_IB_GID_INDEX (show_gids lists them)")
    return DoctorReport(
        sysfs_root=str(sysfs_root), topo_source=topo.source if topo else None, gpus=gpus,
        interfaces=tuple(interfaces), hca_ports=tuple(ports), settings=tuple(settings),
        placements=tuple(placements), notes=tuple(notes),
    )


def _placement_notes(placements: list[GpuPlacement]) -> list[str]:
    notes: list[str] = []
    numa = sorted({p.numa_node for p in placements if p.numa_node is not None})
    if len(numa) > 1:
        notes.append(
            f"GPUs sit on NUMA nodes {', '.join(map(str, numa))}: bind each local rank to its "
            "GPU's node (numactl --cpunodebind=N --membind=N, or the CPUs listed above)"
        )
    far = [p.gpu for p in placements if p.link in ("PHB", "NODE", "SYS", "SOC")]
    if far:
        notes.append(
            f"{', '.join(far)}: nearest NIC is past the PCIe switch (PHB/NODE/SYS): NCCL may "
            "stage network traffic through host memory there (NCCL_NET_GDR_LEVEL)"
        )
    down = sorted({p.nic for p in placements if p.nic and p.nic_state not in (None, "ACTIVE")})
    if down:
        notes.append(f"{', '.join(down)}: nearest NIC of some GPU but not active")
    return notes


def format_report(report: DoctorReport) -> str:
    """The human-readable report: what was found, each setting with its reason, the placements."""
    out = [f"torsh-dist doctor: sysfs root {report.sysfs_root}"]
    out.append(f"GPUs: {len(report.gpus)}" + (f" ({report.topo_source})" if report.gpus else ""))
    out.append("network interfaces:")
    for i in report.interfaces:
        speed = f"{i.speed_mbps / 1000:g} Gb/s" if i.speed_mbps else "-"
        numa = f"NUMA {i.numa_node}" if i.numa_node is not None else ""
        extra = f"  ({'IPoIB ' if i.is_ipoib else ''}{i.hca})" if i.hca else ""
        out.append(f"  {i.name:<14}{i.operstate:<9}{speed:<11}{i.kind:<10}{numa}{extra}".rstrip())
    out.append("InfiniBand/RoCE ports:" + ("" if report.hca_ports else " none"))
    for p in report.hca_ports:
        rate = f"{p.rate_gbps:g} Gb/s" if p.rate_gbps else "-"
        numa = f"NUMA {p.numa_node}" if p.numa_node is not None else ""
        net = f"  {','.join(p.netdevs)}" if p.netdevs else ""
        out.append(f"  {p.name:<14}{p.state:<9}{p.link_layer:<12}{rate:<11}{numa}{net}".rstrip())
    out.append("settings:")
    for s in report.settings:
        head = f"{s.name}={s.value}" if s.value is not None else f"{s.name} (leave unset)"
        if s.current is not None and s.current != s.value:
            head += f"   [now {s.current!r}]"
        out += [f"  {head}", f"      {s.reason}"]
    if report.placements:
        out.append("local rank -> GPU -> nearest NIC, NUMA node, CPUs:")
        for p in report.placements:
            nic = f"{p.nic} ({p.link}{'' if p.nic_state in (None, 'ACTIVE') else ', ' + p.nic_state})" \
                if p.nic else "no NIC listed"
            numa = f"NUMA {p.numa_node}" if p.numa_node is not None else "NUMA ?"
            out.append(f"  {p.local_rank:>2}  {p.gpu:<6} {nic:<26} {numa:<8} CPUs {p.cpus or '?'}")
        out.append("  (NCCL picks each GPU's NIC from the PCI tree itself; this is the same choice,"
                   " for checking and for per-rank tools such as UCX_NET_DEVICES)")
    if report.notes:
        out.append("notes:")
        out += [f"  - {n}" for n in report.notes]
    return "\n".join(out)


def format_env(report: DoctorReport) -> str:
    """``export VAR=value  # reason`` lines for a shell, one per setting with a value."""
    lines = []
    for s in report.settings:
        if s.value is not None:
            lines.append(f"export {s.name}={shlex.quote(s.value)}  # {s.reason}")
        else:
            lines.append(f"# {s.name} unset: {s.reason}")
    return "\n".join(lines)
