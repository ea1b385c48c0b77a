"""Peer-replicated checkpoints on 3 simulated hosts (``TORSH_NODE_ASSIGNMENT``), one directory each.

Real Gloo ranks and DCP saves through :class:`CheckpointManager` with ``peer_replicas``: the
replicas land where the ring says, a host whose directory is gone gets the whole checkpoint back
from its peers (bit for bit), a corrupted replica is detected by its SHA-256 and another copy is
used, or an older complete checkpoint, or a clear error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from torsh_distributed.checkpoint import CheckpointManager, step_dir_name, verify
from torsh_distributed.runtime.errors import CheckpointError
from torsh_distributed.testing import run_distributed

HOSTS = {"TORSH_NODE_ASSIGNMENT": "0,1,2"}

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _host_dir(base: str) -> Path:
    import torch.distributed as dist

    return Path(base) / f"host{dist.get_rank()}"


def _save(base: str, replicas: int, steps: list[int]) -> dict:
    """Train the same model on every rank (as DDP would) and save at ``steps``; return the final
    state and what replication moved."""
    model, opt = _model(0)
    manager = CheckpointManager(_host_dir(base), peer_replicas=replicas, keep_last=0)
    states = {}
    for step in range(1, max(steps) + 1):
        torch.manual_seed(100 + step)
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in steps:
            manager.save(step, model=model, optimizer=opt, extra={"step": step})
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    manager.close()
    stats = manager.peer.stats if manager.peer is not None else None
    return {
        "states": states,
        "sent": stats.bytes_sent if stats else 0,
        "received": stats.bytes_received if stats else 0,
        "saves": stats.saves if stats else 0,
    }


def _load(base: str, replicas: int) -> dict:
    model, opt = _model(1)  # other initial values: only the checkpoint can make them equal
    manager = CheckpointManager(_host_dir(base), peer_replicas=replicas, keep_last=0)
    try:
        loaded = manager.load(model=model, optimizer=opt)
    except CheckpointError as exc:
        return {"error": str(exc)}
    assert loaded is not None
    return {
        "step": loaded.step,
        "skipped": loaded.skipped,
        "state": model.state_dict(),
        "restored": manager.peer.stats.restored_bytes if manager.peer else 0,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """Steps 2 and 4 saved with one peer replica; the pristine directories are kept in ``orig``."""
    base = tmp_path_factory.mktemp("peer")
    result = run_distributed(_save, 3, args=(str(base / "orig"), 1, [2, 4]), env=HOSTS, timeout=120)
    return base, result[0]


def _copy(base: Path, name: str) -> Path:
    shutil.copytree(base / "orig", base / name)
    return base / name


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


@pytest.mark.timeout(180)
def test_each_host_keeps_its_files_and_its_predecessors(saved) -> None:
    base, first = saved
    assert first["saves"] == 2 and first["sent"] > 0
    for host in range(3):
        step = base / "orig" / f"host{host}" / step_dir_name(4)
        manifest = json.loads((step / "manifest.json").read_text())["files"]
        previous = (host - 1) % 3  # the ring: rank r's replica lives on host r + 1
        held = _files(step)
        assert {f"__{host}_0.distcp", f"__{previous}_0.distcp"} <= held
        assert f"__{(host + 1) % 3}_0.distcp" not in held
        assert {"COMMITTED", "manifest.json", "meta.json", ".metadata"} <= held
        # the manifest lists the whole checkpoint, this host holds part of it
        assert {f"__{r}_0.distcp" for r in range(3)} <= set(manifest)
        assert not verify(step).valid  # not a complete checkpoint on its own
        assert not list((base / "orig" / f"host{host}").glob(".tmp-*"))


@pytest.mark.timeout(180)
def test_a_host_whose_directory_is_gone_resumes_from_its_peers(saved) -> None:
    base, first = saved
    work = _copy(base, "gone")
    shutil.rmtree(work / "host1")  # a replaced node: an empty local disk
    result = run_distributed(_load, 3, args=(str(work), 1), env=HOSTS, timeout=120)
    for rank in range(3):
        assert result[rank]["step"] == 4
        for name, value in first["states"][4].items():
            assert torch.equal(result[rank]["state"][name], value), (rank, name)
    assert result[1]["restored"] == 0 and result[0]["restored"] + result[2]["restored"] > 0
    for host in range(3):  # every host now holds a complete, verified copy
        assert verify(work / f"host{host}" / step_dir_name(4)).valid


@pytest.mark.timeout(180)
def test_a_corrupted_replica_falls_back_to_the_previous_complete_step(saved) -> None:
    base, first = saved
    work = _copy(base, "corrupt")
    shutil.rmtree(work / "host1")
    _flip(work / "host2" / step_dir_name(4) / "__1_0.distcp")  # rank 1's only other copy
    result = run_distributed(_load, 3, args=(str(work), 1), env=HOSTS, timeout=120)
    assert result[0]["step"] == 2, result[0]
    assert "step 4" in result[0]["skipped"][0] and "__1_0.distcp" in result[0]["skipped"][0]
    assert "SHA-256 mismatch" in result[0]["skipped"][0]
    for name, value in first["states"][2].items():
        assert torch.equal(result[1]["state"][name], value), name


@pytest.mark.timeout(180)
def test_no_intact_copy_at_all_is_a_clear_error(saved) -> None:
    base, _ = saved
    work = _copy(base, "lost")
    shutil.rmtree(work / "host1")
    for step in (2, 4):
        _flip(work / "host2" / step_dir_name(step) / "__1_0.distcp")
    result = run_distributed(_load, 3, args=(str(work), 1), env=HOSTS, timeout=120)
    for rank in range(3):
        error = result[rank]["error"]
        assert "no checkpoint can be restored" in error and "__1_0.distcp" in error, error


@pytest.mark.timeout(240)
def test_with_two_replicas_a_corrupted_copy_is_replaced_by_another(tmp_path) -> None:
    first = run_distributed(_save, 3, args=(str(tmp_path), 2, [3]), env=HOSTS, timeout=120)[0]
    shutil.rmtree(tmp_path / "host1")
    _flip(tmp_path / "host2" / step_dir_name(3) / "__1_0.distcp")
    _flip(tmp_path / "host0" / step_dir_name(3) / "__2_0.distcp")  # host 0's own copy is fine
    result = run_distributed(_load, 3, args=(str(tmp_path), 2), env=HOSTS, timeout=120)
    for rank in range(3):
        assert result[rank]["step"] == 3
        for name, value in first["states"][3].items():
            assert torch.equal(result[rank]["state"][name], value), (rank, name)
    for host in range(3):  # the corrupt copies were replaced by intact ones
        assert verify(tmp_path / f"host{host}" / step_dir_name(3)).valid


def _shared(base: str) -> str:
    try:
        CheckpointManager(base, peer_replicas=1)
    except CheckpointError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
def test_a_directory_shared_by_hosts_is_refused(tmp_path) -> None:
    result = run_distributed(_shared, 3, args=(str(tmp_path),), env=HOSTS, timeout=60)
    assert all("write to one directory" in r for r in result), result


@pytest.mark.timeout(180)
def test_resume_on_fewer_hosts_reshards_from_the_peers_copies(saved) -> None:
    base, first = saved
    work = _copy(base, "fewer")
    shutil.rmtree(work / "host2")  # host 2 is gone for good; 2 hosts go on
    result = run_distributed(
        _load, 2, args=(str(work), 1), env={"TORSH_NODE_ASSIGNMENT": "0,1"}, timeout=120
    )
    for rank in range(2):
        assert result[rank]["step"] == 4
        for name, value in first["states"][4].items():
            assert torch.equal(result[rank]["state"][name], value), (rank, name)
