"""Peer replicas without processes: ring placement, host inventories, the restore plan, config."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from torsh_distributed.checkpoint import manifest
from torsh_distributed.checkpoint._peer_plan import PeerLayout, inventory, own_files, plan_restore
from torsh_distributed.checkpoint.config import CheckpointConfig


def test_ring_places_replicas_on_the_next_hosts() -> None:
    layout = PeerLayout(nodes=(0, 0, 1, 1, 2, 2), replicas=1)
    assert layout.leads == [0, 2, 4]
    assert [layout.targets(r) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert layout.sources(0) == [4]
    two = PeerLayout(nodes=(0, 0, 1, 1, 2, 2), replicas=2)
    assert two.targets(1) == [3, 5] and sorted(two.sources(1)) == [3, 5]


def test_uneven_hosts_still_get_every_replica_elsewhere() -> None:
    layout = PeerLayout(nodes=(5, 5, 9), replicas=1)  # ids need not be 0..n-1
    assert layout.targets(0) == [2] and layout.targets(1) == [2]
    assert layout.targets(2) == [0]
    for rank in range(3):
        assert all(layout.nodes[t] != layout.nodes[rank] for t in layout.targets(rank))


def test_too_few_hosts_for_the_replicas_is_refused() -> None:
    with pytest.raises(
        ValueError, match="peer_replicas 2 needs at least 3 hosts, this job runs on 2"
    ):
        PeerLayout(nodes=(0, 0, 1, 1), replicas=2)


def _step(root: Path, step: int, files: dict[str, bytes], held: list[str]) -> None:
    """A committed step directory holding only ``held`` of ``files``."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    entries = {
        n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()
    }
    for name in held:
        (path / name).write_bytes(files[name])
    manifest.atomic_write_text(path / manifest.MANIFEST, json.dumps({"files": entries}))
    digest = manifest.sha256_file(path / manifest.MANIFEST)
    manifest.write_marker(path, step=step, manifest_sha256=digest)


FILES = {"__0_0.distcp": b"a" * 10, "__1_0.distcp": b"b" * 20, "__2_0.distcp": b"c" * 30}


def test_inventory_names_what_is_held_intact_and_what_is_corrupt(tmp_path: Path) -> None:
    _step(tmp_path, 4, FILES, ["__0_0.distcp", "__2_0.distcp"])
    (tmp_path / "step_00000004" / "__2_0.distcp").write_bytes(b"x" * 30)  # same size, new bytes
    (tmp_path / ".tmp-step_00000008").mkdir()  # never committed: not reported
    got = inventory(tmp_path)
    assert list(got) == ["4"]
    assert got["4"]["held"] == ["__0_0.distcp"]
    assert got["4"]["bad"] == {"__2_0.distcp": "SHA-256 mismatch (corrupt)"}
    assert got["4"]["files"] == sorted(FILES)


def test_plan_picks_the_newest_step_the_hosts_hold_completely(tmp_path: Path) -> None:
    hosts = [tmp_path / f"h{i}" for i in range(3)]
    # step 8: host 1 never committed it, so rank 1's files exist nowhere
    _step(hosts[0], 8, FILES, ["__0_0.distcp", "__2_0.distcp"])
    _step(hosts[2], 8, FILES, ["__2_0.distcp"])
    # step 4: complete between hosts 0 and 2 (host 1's directory is empty: a new node)
    _step(hosts[0], 4, FILES, ["__0_0.distcp", "__2_0.distcp"])
    _step(hosts[2], 4, FILES, ["__2_0.distcp", "__1_0.distcp"])
    hosts[1].mkdir()
    plan = plan_restore([inventory(h) for h in hosts], leads=[0, 1, 2])
    assert plan.step == 4
    assert "step 8" in plan.skipped[0] and "__1_0.distcp (on no host)" in plan.skipped[0]
    assert plan.transfers == [
        (0, 1, ["manifest.json", "__0_0.distcp", "__2_0.distcp"]),
        (0, 2, ["__0_0.distcp"]),
        (2, 0, ["__1_0.distcp"]),
        (2, 1, ["__1_0.distcp"]),
    ]


def test_plan_without_any_checkpoint_and_with_only_broken_ones(tmp_path: Path) -> None:
    assert plan_restore([{}, {}], leads=[0, 1]).step is None
    assert not plan_restore([{}, {}], leads=[0, 1]).committed
    _step(tmp_path, 4, FILES, ["__0_0.distcp"])
    plan = plan_restore([inventory(tmp_path), {}], leads=[0, 1])
    assert plan.step is None and plan.committed
    assert "__1_0.distcp (on no host), __2_0.distcp (on no host)" in plan.skipped[0]


def test_own_files_are_the_ranks_shards_and_rank_files(tmp_path: Path) -> None:
    for name in (
        "__0_0.distcp",
        "__1_0.distcp",
        "rank_00001.json",
        "rank_00001.pt",
        "rank_00000.json",
        ".metadata",
        "meta.json",
    ):
        (tmp_path / name).write_bytes(b"x")
    assert own_files(tmp_path, 1) == ["__1_0.distcp", "rank_00001.json", "rank_00001.pt"]
    assert own_files(tmp_path, 0) == [".metadata", "__0_0.distcp", "meta.json", "rank_00000.json"]


def test_config_validates_peer_replicas() -> None:
    assert CheckpointConfig(dir="d", peer_replicas=1).peer_replicas == 1
    with pytest.raises(ValueError, match="peer_replicas must be >= 0"):
        CheckpointConfig(dir="d", peer_replicas=-1)
    with pytest.raises(ValueError, match="peer_replicas needs checkpoint.dir"):
        CheckpointConfig(peer_replicas=1)
    with pytest.raises(ValueError, match="keep_last must be 0 or >= 2"):
        CheckpointConfig(dir="d", peer_replicas=1, keep_last=1)
