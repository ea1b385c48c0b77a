"""Checkpoints that outlive a host without a shared file system (``checkpoint.peer_replicas k``).

Every host writes its ranks' shards into its own local checkpoint directory (the same path
on every host or not; it must not be shared). When DCP has written them, in the save's
background thread:

1. every rank hashes the files it wrote (SHA-256) and the digests are all-gathered, so every host
   builds the same ``manifest.json`` of the whole checkpoint;
2. rank 0's small common files (DCP's ``.metadata``, ``meta.json``) are broadcast to every host;
3. each rank sends its files, as they lie on disk, to one rank on each of the next ``k`` hosts of
   a ring (:class:`~torsh_distributed.checkpoint._peer_plan.PeerLayout`); a receiver holds them
   in memory, checks each against the digests and writes it into its host's ``.tmp-step_N/``;
4. after a barrier (every host has every file it should keep), each host commits its directory
   as today: ``manifest.json``, ``COMMITTED``, rename to ``step_N/``.

So a host's ``step_N/`` holds its own shards plus the replicas it keeps, with the manifest of the
whole checkpoint. A kill before step 4 leaves only ``.tmp-`` directories (never loaded, removed at
the next start); a kill during step 4 leaves some hosts committed, and a resume uses step N only
when the hosts still hold every file of it intact.

Resume (:meth:`PeerReplicator.restore`, collective): every host reports what it holds intact
(re-hashed), all ranks compute the same plan (the newest checkpoint whose every file has an intact
copy on some host, :func:`~torsh_distributed.checkpoint._peer_plan.plan_restore`), and missing files
are sent host to host, each verified before it is written, until every host holds a complete copy;
the ordinary loader then reads the local directory (and reshards, as DCP does, when the world size
changed). A replaced host with an empty directory receives the whole checkpoint.

Transport: the job's own process group (a dedicated Gloo group; ``uint8`` tensors for file bytes,
JSON for control), not a server of our own: no extra port, no second authentication scheme, the
interface the job already uses, and nothing unpickled. Its cost: replication needs the job's
ranks alive, which they are whenever a save or a resume runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torsh_distributed.checkpoint import faults, manifest
from torsh_distributed.checkpoint._peer_plan import (
    COMMON_FILES,
    PART_PREFIX,
    PeerLayout,
    inventory,
    local_node_id,
    own_files,
    plan_restore,
)
from torsh_distributed.checkpoint._peer_wire import (
    all_gather_json,
    broadcast_bytes,
    exchange,
    recv_bytes,
    send_bytes,
)
from torsh_distributed.checkpoint.catalog import step_dir_name
from torsh_distributed.runtime.errors import CheckpointError

__all__ = ["PeerReplicator", "ReplicationStats"]

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"


class ReplicationStats:
    """Running totals of what replication moved (this rank)."""

    def __init__(self) -> None:
        self.saves = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_bytes_sent = 0
        self.restored_bytes = 0


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fp:
        fp.write(data)
        fp.flush()
        os.fsync(fp.fileno())


def _split(data: bytes, sizes: list[tuple[str, int]]) -> list[tuple[str, bytes]]:
    out, offset = [], 0
    for name, size in sizes:
        out.append((name, data[offset : offset + size]))
        offset += size
    if offset != len(data):
        raise CheckpointError(f"replica of {len(data)} bytes, the manifest lists {offset}")
    return out


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class PeerReplicator:
    """Replicates each save to ``replicas`` other hosts and restores from them (see module doc).

    Construct collectively on every rank (after the process group); it finds the hosts and
    refuses a directory that two hosts share (the shared-file-system case needs no replicas).

    Args:
        directory: This host's checkpoint root.
        replicas: Copies of each rank's files on other hosts (``k``); the job needs ``k + 1``
            hosts. Each copy costs the receiving host the sender's shard bytes per save on the
            network and on disk.
        group: A Gloo group for the control messages and the restore (main thread).
    """

    def __init__(self, directory: Path, *, replicas: int, group: dist.ProcessGroup) -> None:
        self.directory = directory
        self.rank = dist.get_rank()
        nodes = all_gather_json(local_node_id(self.rank), group)
        self.layout = PeerLayout(nodes=tuple(int(n) for n in nodes), replicas=replicas)
        self.is_lead = self.layout.lead(self.rank) == self.rank
        self.stats = ReplicationStats()

    def check_distinct(self, group: dist.ProcessGroup) -> None:
        """Refuse a directory that several hosts see (collective; after the leads created it)."""
        nonce = broadcast_bytes(
            f"{random.getrandbits(48):012x}".encode() if self.rank == 0 else None,
            src=0,
            group=group,
        ).decode()
        node = self.layout.nodes[self.rank]
        probe = self.directory / f".peer-probe-{nonce}-{node}"
        if self.is_lead:
            probe.write_text(str(node))
        dist.barrier(group=group)
        seen = sorted(p.name for p in self.directory.glob(f".peer-probe-{nonce}-*"))
        clash = all_gather_json(seen if self.is_lead and len(seen) > 1 else [], group)
        dist.barrier(group=group)
        if self.is_lead:
            probe.unlink(missing_ok=True)
        shared = next((c for c in clash if c), None)
        if shared:
            hosts = ", ".join(name.rsplit("-", 1)[1] for name in shared)
            raise CheckpointError(
                f"checkpoint.peer_replicas: hosts {hosts} write to one directory "
                f"({self.directory}); peer replicas need a local directory per host",
                rank=self.rank,
                operation="checkpoint.init",
                fix="give each host its own --checkpoint-dir, or drop --checkpoint.peer-replicas "
                "on a shared file system",
            )

    # --- saving --------------------------------------------------------------------------------

    def commit(self, tmp: Path, final: Path, step: int, group: dist.ProcessGroup) -> None:
        """Replicate the files of ``tmp`` and commit it on every host (collective on ``group``,
        the save's own group: this runs in the background save's thread)."""
        mine = own_files(tmp, self.rank)
        blobs = {name: (tmp / name).read_bytes() for name in mine}
        records = {n: {"size": len(b), "sha256": _sha(b)} for n, b in blobs.items()}
        gathered = all_gather_json(records, group)
        files: dict[str, dict[str, Any]] = {}
        owner: dict[str, int] = {}
        for rank, theirs in enumerate(gathered):
            for name, entry in theirs.items():
                files[name], owner[name] = entry, rank
        for name in COMMON_FILES:
            if name not in files:
                continue
            data = broadcast_bytes(blobs.get(name), src=0, group=group)
            if self.is_lead and not (tmp / name).exists():
                self._verified_write(tmp, name, data, files[name])
        payload = b"".join(blobs[n] for n in mine if n not in COMMON_FILES)
        targets = self.layout.targets(self.rank)
        received = exchange(
            {t: payload for t in targets}, self.layout.sources(self.rank), group=group
        )
        self.stats.last_bytes_sent = len(payload) * len(targets)
        self.stats.bytes_sent += self.stats.last_bytes_sent
        for src, data in sorted(received.items()):
            self.stats.bytes_received += len(data)
            names = sorted(n for n, o in owner.items() if o == src and n not in COMMON_FILES)
            parts = _split(data, [(n, int(files[n]["size"])) for n in names])
            for name, part in parts:
                self._verified_write(tmp, name, part, files[name])
                # a kill injected here leaves a half-written replica in .tmp-step_N
                faults.on_replica_written(step, self.rank)
        dist.barrier(group=group)
        self.stats.saves += 1
        if self.is_lead:
            text = json.dumps(
                {
                    "format": manifest.FORMAT_VERSION,
                    "algorithm": "sha256",
                    "files": dict(sorted(files.items())),
                },
                indent=1,
            )
            manifest.atomic_write_text(tmp / manifest.MANIFEST, text)
            digest = manifest.sha256_file(tmp / manifest.MANIFEST)
            manifest.write_marker(tmp, step=step, manifest_sha256=digest)
            if final.exists():
                shutil.rmtree(final)  # an older save of the same step (after a restart)
            tmp.rename(final)

    def _verified_write(
        self, directory: Path, name: str, data: bytes, entry: dict[str, Any]
    ) -> None:
        if len(data) != entry["size"] or _sha(data) != entry["sha256"]:
            raise CheckpointError(
                f"replica {name} for {directory.name} arrived corrupt (SHA-256 or size mismatch)",
                rank=self.rank,
                operation="checkpoint.replicate",
            )
        _write(directory / name, data)

    # --- resuming ------------------------------------------------------------------------------

    def restore(self, group: dist.ProcessGroup) -> tuple[int | None, list[str]]:
        """Give every host a complete copy of the newest checkpoint the hosts hold completely
        between them (collective). Returns its step (``None``: no checkpoint at all) and lines
        naming the newer checkpoints that could not be used.

        Raises:
            CheckpointError: checkpoints exist but none has an intact copy of every file.
        """
        mine = inventory(self.directory) if self.is_lead else {}
        plan = plan_restore(all_gather_json(mine, group), self.layout.leads)
        if plan.step is None:
            if plan.committed:
                raise CheckpointError(
                    "no checkpoint can be restored from the hosts' directories: "
                    + "; ".join(plan.skipped),
                    rank=self.rank,
                    operation="checkpoint.load",
                    fix="bring back a host that holds the missing files, or start afresh "
                    "with --resume never",
                )
            return None, []
        final = self.directory / step_dir_name(plan.step)
        holds = mine.get(str(plan.step), {}).get("manifest") == plan.manifest_sha256
        target = final if holds else self.directory / f"{_TMP_PREFIX}{final.name}"
        expected: dict[str, dict[str, Any]] = {}
        if holds:
            expected = json.loads((final / manifest.MANIFEST).read_text())["files"]
        elif self.is_lead:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
        for src, dst, names in plan.transfers:
            if self.rank == src:
                body = b"".join((final / n).read_bytes() for n in names)
                header = json.dumps([[n, (final / n).stat().st_size] for n in names]).encode()
                send_bytes(header, dst=dst, group=group)
                send_bytes(body, dst=dst, group=group)
                self.stats.restored_bytes += len(body)
            elif self.rank == dst:
                header = json.loads(recv_bytes(src=src, group=group))
                body = recv_bytes(src=src, group=group)
                for name, data in _split(body, [(n, int(s)) for n, s in header]):
                    if name == manifest.MANIFEST:
                        if _sha(data) != plan.manifest_sha256:
                            raise CheckpointError(
                                f"manifest of step {plan.step} from rank {src} does not match "
                                "the committed one",
                                rank=self.rank,
                                operation="checkpoint.load",
                            )
                        _write(target / name, data)
                        expected = json.loads(data)["files"]
                        continue
                    part = target / f"{PART_PREFIX}{name}"
                    self._verified_write(target, part.name, data, expected[name])
                    os.replace(part, target / name)
        if self.is_lead and not holds:
            manifest.write_marker(target, step=plan.step, manifest_sha256=plan.manifest_sha256)
            if final.exists():
                shutil.rmtree(final)  # another save of this step that the hosts outvoted
            target.rename(final)
        dist.barrier(group=group)
        for line in plan.skipped:
            log.warning("checkpoint: skipping %s", line)
        return plan.step, plan.skipped
