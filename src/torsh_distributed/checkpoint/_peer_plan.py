"""Pure planning for peer-replicated checkpoints: who holds whose files, what a resume can use.

No process group and no torch here (unit-tested in one process): :class:`PeerLayout` places each
rank's replicas on the next hosts of a ring, :func:`inventory` says which files of which committed
checkpoint a host's directory holds intact (SHA-256 against the manifest), :func:`plan_restore`
picks the newest checkpoint whose every file has an intact copy on some host and lists the
transfers that give every host a complete copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torsh_distributed.checkpoint import manifest

__all__ = [
    "COMMON_FILES",
    "PART_PREFIX",
    "PeerLayout",
    "RestorePlan",
    "inventory",
    "local_node_id",
    "own_files",
    "plan_restore",
]

COMMON_FILES = (".metadata", manifest.META)
"""Rank 0's files that every host receives (small: DCP's index and the run's metadata)."""
PART_PREFIX = ".peer-part-"
"""A file being received into a committed directory; renamed into place once verified."""
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def local_node_id(rank: int) -> int:
    """This rank's host: ``TORSH_NODE_ASSIGNMENT`` (simulated hosts), else the launcher's
    ``GROUP_RANK`` (torchrun's node rank), else a number derived from the host name."""
    env = os.environ.get("TORSH_NODE_ASSIGNMENT")
    if env:
        return int(env.split(",")[rank])
    if os.environ.get("GROUP_RANK", "").isdigit():
        return int(os.environ["GROUP_RANK"])
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:6], "big")


@dataclass(frozen=True, slots=True)
class PeerLayout:
    """Hosts of the job (``nodes[rank]`` = host id) and where each rank's replicas go."""

    nodes: tuple[int, ...]
    """Host id of every global rank."""
    replicas: int
    """Copies of each rank's files on other hosts (``k``)."""
    hosts: tuple[int, ...] = field(init=False)
    """Distinct host ids, sorted: the ring."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(sorted(set(self.nodes))))
        if self.replicas < 1:
            raise ValueError(f"peer replicas must be >= 1, got {self.replicas}")
        if self.replicas >= len(self.hosts):
            raise ValueError(
                f"checkpoint.peer_replicas {self.replicas} needs at least {self.replicas + 1} "
                f"hosts, this job runs on {len(self.hosts)} (hosts are told apart by "
                "TORSH_NODE_ASSIGNMENT, the launcher's GROUP_RANK, or the host name)"
            )

    def members(self, host: int) -> list[int]:
        """Global ranks on ``host``, ascending."""
        return [r for r, n in enumerate(self.nodes) if n == host]

    def lead(self, rank: int) -> int:
        """The lowest rank of ``rank``'s host: it writes the host's shared files."""
        return self.members(self.nodes[rank])[0]

    @property
    def leads(self) -> list[int]:
        """One rank per host (its lowest), in host order."""
        return [self.members(h)[0] for h in self.hosts]

    def targets(self, rank: int) -> list[int]:
        """Ranks that keep ``rank``'s replicas: one on each of the next ``replicas`` hosts of the
        ring, the member at ``rank``'s position on its own host (modulo that host's size)."""
        host_index = self.hosts.index(self.nodes[rank])
        position = self.members(self.nodes[rank]).index(rank)
        out = []
        for j in range(1, self.replicas + 1):
            peers = self.members(self.hosts[(host_index + j) % len(self.hosts)])
            out.append(peers[position % len(peers)])
        return out

    def sources(self, rank: int) -> list[int]:
        """Ranks whose replicas ``rank`` keeps."""
        return [s for s in range(len(self.nodes)) if rank in self.targets(s)]


def own_files(directory: Path, rank: int) -> list[str]:
    """The files ``rank`` wrote into a checkpoint directory: its DCP shard(s) and rank files,
    and rank 0's :data:`COMMON_FILES`."""
    names = []
    for path in directory.iterdir():
        name = path.name
        if name.startswith(f"__{rank}_") and name.endswith(".distcp"):
            names.append(name)
        elif name.startswith(f"rank_{rank:05d}."):
            names.append(name)
        elif rank == 0 and name in COMMON_FILES:
            names.append(name)
    return sorted(names)


def _check(path: Path, entry: Mapping[str, Any]) -> str:
    """Why ``path`` is not the file ``entry`` describes; empty when it is."""
    size = path.stat().st_size
    if size != entry.get("size"):
        return f"size {size} bytes, manifest says {entry.get('size')} (truncated?)"
    if manifest.sha256_file(path) != entry.get("sha256"):
        return "SHA-256 mismatch (corrupt)"
    return ""


def inventory(directory: Path) -> dict[str, Any]:
    """What ``directory`` holds intact: ``{step: {"manifest", "files", "held", "bad"}}`` for every
    committed ``step_*`` (``manifest``: its SHA-256 per the commit marker; ``files``: every file
    it lists; ``held``: those present here with the listed size and SHA-256; ``bad``: those
    present but not intact, with the reason). Leftover partial transfers are removed."""
    out: dict[str, Any] = {}
    if not directory.is_dir():
        return out
    for child in sorted(directory.iterdir()):
        match = _STEP_DIR.match(child.name)
        if not match or not (child / manifest.MARKER).is_file():
            continue
        for stale in child.glob(f"{PART_PREFIX}*"):
            stale.unlink(missing_ok=True)
        try:
            marker = json.loads((child / manifest.MARKER).read_text())
            digest = str(marker["manifest_sha256"])
            if manifest.sha256_file(child / manifest.MANIFEST) != digest:
                continue  # a manifest that is not the committed one: the host holds nothing
            files = json.loads((child / manifest.MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        held, bad = [], {}
        for name, entry in sorted(files.items()):
            if (child / name).is_file():
                reason = _check(child / name, entry)
                if reason:
                    bad[name] = reason
                else:
                    held.append(name)
        out[str(int(match.group(1)))] = {
            "manifest": digest,
            "files": sorted(files),
            "held": held,
            "bad": bad,
        }
    return out


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What :func:`plan_restore` decided."""

    step: int | None
    """The checkpoint to resume from; ``None`` when no committed checkpoint is complete."""
    manifest_sha256: str = ""
    """SHA-256 of its manifest (what every received ``manifest.json`` must hash to)."""
    transfers: list[tuple[int, int, list[str]]] = field(default_factory=list)
    """``(source rank, destination rank, file names)`` in the order every rank executes them."""
    skipped: list[str] = field(default_factory=list)
    """Newer checkpoints that could not be used, each with the files no host holds intact."""
    committed: bool = False
    """Whether any host holds any committed checkpoint at all."""


def plan_restore(inventories: Sequence[Mapping[str, Any]], leads: Sequence[int]) -> RestorePlan:
    """The newest checkpoint that the hosts hold completely between them, and the transfers that
    make every host's copy complete.

    Args:
        inventories: :func:`inventory` of every rank (non-lead ranks report ``{}``).
        leads: The rank that speaks for each host (its inventory, its transfers).
    """
    steps = sorted({int(s) for r in leads for s in inventories[r]}, reverse=True)
    skipped = []
    for step in steps:
        key = str(step)
        holders = {r: inventories[r][key] for r in leads if key in inventories[r]}
        # Hosts agree on the manifest of a step unless a save of the same step was redone
        # after a restart; the most common manifest wins and the others count as not holding it.
        digest, _ = Counter(h["manifest"] for h in holders.values()).most_common(1)[0]
        holders = {r: h for r, h in holders.items() if h["manifest"] == digest}
        files = next(iter(holders.values()))["files"]
        missing = [
            f
            for f in [*files, manifest.MANIFEST]
            if not any(f == manifest.MANIFEST or f in h["held"] for h in holders.values())
        ]
        if missing:
            reasons = []
            for name in missing[:3]:
                bad = [
                    f"rank {r}: {h['bad'][name]}" for r, h in holders.items() if name in h["bad"]
                ]
                reasons.append(f"{name} ({'; '.join(bad) if bad else 'on no host'})")
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            skipped.append(f"step {step}: no intact copy on any host of {', '.join(reasons)}{more}")
            continue
        transfers: dict[tuple[int, int], list[str]] = {}
        for dst in leads:
            mine = holders.get(dst)
            need = [manifest.MANIFEST] if mine is None else []
            need += [f for f in files if mine is None or f not in mine["held"]]
            for name in need:
                src = next(
                    r
                    for r, h in holders.items()
                    if r != dst and (name == manifest.MANIFEST or name in h["held"])
                )
                transfers.setdefault((src, dst), []).append(name)
        return RestorePlan(
            step=step,
            manifest_sha256=digest,
            transfers=[(s, d, names) for (s, d), names in sorted(transfers.items())],
            skipped=skipped,
            committed=True,
        )
    return RestorePlan(step=None, skipped=skipped, committed=bool(steps))
