"""The decisions behind ``torsh-dist doctor``: socket interfaces, HCAs, GPU-NIC rails, notes.

Each function returns a value and the one-line reason for it; :mod:`.topology` assembles them.
The rules follow what NCCL itself does and documents (NCCL's environment-variable reference):
``NCCL_SOCKET_IFNAME`` and ``NCCL_IB_HCA`` are prefix lists unless they start with ``=``; NCCL
picks each GPU's NIC by PCI distance (PIX < PXB < PHB < NODE < SYS) and we mirror that so the
choice can be read and checked.
"""

from __future__ import annotations

import re

from torsh_distributed.runtime._sysfs import HcaPort, NetInterface
from torsh_distributed.runtime._topo_parse import TopoMatrix, link_rank

__all__ = ["choose_hcas", "choose_socket_interfaces", "exact_list", "gpu_rails", "link_notes"]


def _gbps(speed_mbps: int | None) -> str:
    if speed_mbps is None:
        return "speed unknown"
    return f"{speed_mbps / 1000:g} Gb/s"


def exact_list(chosen: list[str], every: list[str]) -> str:
    """``a,b`` as NCCL reads it: ``=`` in front when a name is a prefix of one not chosen.

    NCCL matches ``NCCL_SOCKET_IFNAME`` / ``NCCL_IB_HCA`` entries as prefixes, so ``mlx5_1``
    would also select ``mlx5_10``; ``=`` makes the whole list exact.
    """
    base = [c.split(":")[0] for c in chosen]
    others = [e for e in every if e not in base]
    ambiguous = any(o.startswith(b) for b in base for o in others)
    return ("=" if ambiguous else "") + ",".join(chosen)


def choose_socket_interfaces(interfaces: list[NetInterface]) -> tuple[list[str], str]:
    """The interfaces for NCCL's and Gloo's sockets, and why.

    Candidates are up and physical (or bonds of physical ones); loopback, container and other
    virtual interfaces are never used. Ethernet is preferred to IPoIB (an ``ib*`` interface
    often has no address, and its HCA is used natively by NCCL); among the rest, the fastest.
    """
    excluded = [
        f"{i.name} ({i.kind})" for i in interfaces if i.kind in ("loopback", "container", "virtual")
    ]
    down = [f"{i.name} ({i.operstate})" for i in interfaces
            if i.kind in ("physical", "bond") and i.operstate != "up"]
    candidates = [i for i in interfaces if i.kind in ("physical", "bond") and i.operstate == "up"]
    ethernet = [i for i in candidates if not i.is_ipoib]
    pool = ethernet or candidates
    ipoib = [i.name for i in candidates if i.is_ipoib] if ethernet else []
    tail = ""
    if ipoib:
        tail += f"; IPoIB {', '.join(ipoib)} left to NCCL's IB transport"
    if excluded + down:
        tail += f"; not {', '.join(excluded + down)}"
    if not pool:
        return [], "no physical interface is up (only loopback or virtual ones)" + tail
    best = max(i.speed_mbps or 0 for i in pool)
    chosen = sorted((i.name for i in pool if (i.speed_mbps or 0) == best), key=_natural)
    slower = [f"{i.name} ({_gbps(i.speed_mbps)})" for i in pool if i.name not in chosen]
    if slower:
        tail = f"; slower: {', '.join(slower)}" + tail
    what = "bond" if any(i.kind == "bond" for i in pool if i.name in chosen) else "physical"
    rank = "the only one up" if len(pool) == 1 else "the fastest up"
    return chosen, f"{','.join(chosen)}: {what}, {_gbps(best or None)}, {rank}{tail}"


def _natural(name: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _nearest(topo: TopoMatrix, gpu: str, devices: list[str]) -> tuple[list[str], str | None]:
    """The devices at the smallest PCI distance from ``gpu`` (ties in column order)."""
    links = {d: topo.nic_links[(gpu, d)] for d in devices if (gpu, d) in topo.nic_links}
    if not links:
        return [], None
    best = min(link_rank(v) for v in links.values())
    tied = [d for d in topo.nics if d in links and link_rank(links[d]) == best]
    return tied, links[tied[0]]


def gpu_rails(topo: TopoMatrix, ports: list[HcaPort]) -> list[tuple[str, str | None, str | None]]:
    """(GPU, its NIC, the link) per GPU in order: the nearest active HCA, ties shared in turn.

    GPUs with the same set of equally near NICs take them round-robin (GPU0 -> mlx5_0,
    GPU1 -> mlx5_1 under one PCIe switch), which is the rail layout of DGX/HGX machines. When no
    port of the topology's NICs is active (or the tree does not know them), all of its NICs are
    candidates, so the table still shows where each GPU would send.
    """
    active = {p.device for p in ports if p.active}
    candidates = [n for n in topo.nics if n in active] or list(topo.nics)
    groups: dict[tuple[str, ...], int] = {}
    rails: list[tuple[str, str | None, str | None]] = []
    for gpu in topo.gpus:
        tied, link = _nearest(topo, gpu, candidates)
        if not tied:
            rails.append((gpu, None, None))
            continue
        turn = groups.get(tuple(tied), 0)
        groups[tuple(tied)] = turn + 1
        rails.append((gpu, tied[turn % len(tied)], link))
    return rails


def choose_hcas(ports: list[HcaPort], topo: TopoMatrix | None) -> tuple[list[HcaPort], str]:
    """The HCA ports for ``NCCL_IB_HCA``, and why (an empty list: none usable).

    Active ports only. With a topology, only the ports that are the nearest NIC of some GPU
    (storage and management NICs sit across the CPUs from every GPU); then one link layer, the
    fastest's, since an InfiniBand port cannot talk to a RoCE one.
    """
    if not ports:
        return [], "no InfiniBand/RoCE device under /sys/class/infiniband"
    active = [p for p in ports if p.active]
    if not active:
        states = ", ".join(f"{p.name} {p.state}" for p in ports)
        return [], f"no active port ({states})"
    pool, notes = active, []
    if topo is not None and topo.gpus:
        near: set[str] = set()
        known = [p.device for p in active if p.device in topo.nics]
        for gpu in topo.gpus:
            near.update(_nearest(topo, gpu, known)[0])
        if near:
            far = [p for p in active if p.device not in near]
            pool = [p for p in active if p.device in near]
            if far:
                notes.append(f"{', '.join(p.name for p in far)} active but no GPU's nearest NIC")
    fastest = max(pool, key=lambda p: p.rate_gbps or 0.0)
    other_layer = [p for p in pool if p.link_layer != fastest.link_layer]
    if other_layer:
        pool = [p for p in pool if p.link_layer == fastest.link_layer]
        notes.append(f"{', '.join(p.name for p in other_layer)} left out ({other_layer[0].link_layer}"
                     f", the fastest port is {fastest.link_layer})")
    kind = "RoCE" if fastest.link_layer == "Ethernet" else "InfiniBand"
    rates = sorted({p.rate_gbps for p in pool if p.rate_gbps}, reverse=True)
    rate = "/".join(f"{r:g}" for r in rates) + " Gb/s" if rates else "rate unknown"
    where = "the nearest NIC of each GPU" if topo is not None and topo.gpus else "every active port"
    reason = f"{len(pool)} active {kind} port(s), {rate}, {where}"
    return pool, reason + (f"; {'; '.join(notes)}" if notes else "")


def link_notes(topo: TopoMatrix | None) -> list[str]:
    """What the GPU-GPU links mean for NCCL's P2P transport."""
    if topo is None or not topo.gpus:
        return []
    if len(topo.gpus) == 1:
        return ["one GPU: no GPU-to-GPU links"]
    pairs = [(a, b) for i, a in enumerate(topo.gpus) for b in topo.gpus[i + 1:]]
    links = {pair: topo.gpu_links.get(pair, "?") for pair in pairs}
    nvlink = {p: v for p, v in links.items() if v.startswith("NV")}
    if len(nvlink) == len(pairs):
        kinds = sorted(set(nvlink.values()))
        return [f"NVLink between every GPU pair ({', '.join(kinds)}: bonded links): NCCL's P2P "
                "transport uses it; leave NCCL_P2P_DISABLE and NCCL_P2P_LEVEL unset"]
    notes = []
    if nvlink:
        some = ", ".join(f"{a}-{b} {v}" for (a, b), v in list(nvlink.items())[:6])
        notes.append(f"NVLink between some GPU pairs only ({some}); the other pairs use PCIe")
    else:
        notes.append("no NVLink: GPU-to-GPU traffic crosses PCIe")
    sys_pairs = [f"{a}-{b}" for (a, b), v in links.items() if v in ("SYS", "SOC")]
    if sys_pairs:
        shown = ", ".join(sys_pairs[:6]) + (" ..." if len(sys_pairs) > 6 else "")
        notes.append(f"{len(sys_pairs)} GPU pair(s) cross the CPU interconnect (SYS: {shown}): NCCL "
                     "decides by CPU type whether P2P works across it; leave NCCL_P2P_LEVEL "
                     "unset unless a measurement says otherwise")
    return notes
