"""Checkpoint manager in one process: commit, manifest, corruption detection, fallback, safe loading."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from torsh_distributed.checkpoint import CheckpointManager, scan, step_dir_name, verify
from torsh_distributed.checkpoint._safe import SafeFileSystemReader, safe_load_metadata
from torsh_distributed.checkpoint.manifest import MANIFEST, MARKER
from torsh_distributed.cli.main import main as cli_main
from torsh_distributed.runtime.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_optim(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


@pytest.fixture()
def two_checkpoints(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A root with valid checkpoints of steps 1 and 2; returns the root and each step's weights."""
    model, optim = _model_and_optim()
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=0, async_save=True)
    weights = {}
    for step in (1, 2):
        _train_step(model, optim)
        manager.save(step, model=model, optimizer=optim, extra={"note": f"step {step}"})
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    manager.wait()
    return tmp_path / "ckpt", weights


def test_commit_writes_marker_manifest_and_every_rank_file(two_checkpoints):
    root, _ = two_checkpoints
    path = root / step_dir_name(2)
    names = sorted(p.name for p in path.iterdir())
    assert {MARKER, MANIFEST, "meta.json", "rank_00000.json", ".metadata"} <= set(names)
    assert any(n.endswith(".distcp") for n in names)
    assert not list(root.glob(".tmp-*")), "temporary directory left after commit"
    manifest = json.loads((path / MANIFEST).read_text())
    assert set(manifest["files"]) == set(names) - {MARKER, MANIFEST}
    assert verify(path).valid and verify(path).meta["extra"] == {"note": "step 2"}


def test_load_restores_model_optimizer_and_rng(two_checkpoints):
    root, weights = two_checkpoints
    expected_rng = json.loads((root / step_dir_name(2) / "rank_00000.json").read_text())["rng"]
    model, optim = _model_and_optim(seed=99)
    torch.manual_seed(12345)
    loaded = CheckpointManager(root).load(model=model, optimizer=optim)
    assert loaded is not None and loaded.step == 2 and loaded.rng_restored
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[2][name]), name
    assert int(optim.state_dict()["state"][0]["step"]) == 2
    from torsh_distributed.checkpoint.resume import capture_rng

    assert capture_rng()["torch"] == expected_rng["torch"]


def _checkpoint_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file())


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_any_damaged_file_is_detected_and_previous_checkpoint_used(two_checkpoints, damage):
    root, weights = two_checkpoints
    newest = root / step_dir_name(2)
    for name in _checkpoint_files(newest):
        target = newest / name
        original = target.read_bytes()
        if damage == "truncate":
            target.write_bytes(original[: len(original) // 2])
        else:
            flipped = bytearray(original)
            flipped[len(flipped) // 2] ^= 0x01
            target.write_bytes(bytes(flipped))
        verdict = verify(newest)
        assert not verdict.valid, f"{damage} of {name} not detected"
        assert verdict.file in (name, MANIFEST), (name, verdict)
        model, optim = _model_and_optim(seed=5)
        with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000002.*INVALID"):
            loaded = CheckpointManager(root).load(model=model, optimizer=optim)
        assert loaded is not None and loaded.step == 1, f"{damage} of {name}: loaded {loaded}"
        assert torch.equal(model[0].weight, weights[1]["0.weight"])
        assert any(verdict.file in line for line in loaded.skipped)
        target.write_bytes(original)
        assert verify(newest).valid


def test_partial_checkpoints_are_never_loaded(two_checkpoints):
    root, _ = two_checkpoints
    (root / step_dir_name(2) / MARKER).unlink()  # renamed but not marked: a partial save
    tmp = root / ".tmp-step_00000003"  # a save killed mid-write
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"partial")
    assert verify(root / step_dir_name(2)).reason.startswith("no commit marker")
    model, optim = _model_and_optim()
    with pytest.warns(UserWarning, match="no commit marker"):
        manager = CheckpointManager(root)
        loaded = manager.load(model=model, optimizer=optim)
    assert loaded.step == 1
    assert not tmp.exists(), "the stale temporary directory was not removed"


def test_unlisted_and_missing_files_are_reported(two_checkpoints):
    root, _ = two_checkpoints
    path = root / step_dir_name(2)
    (path / "stray.bin").write_bytes(b"x")
    verdict = verify(path)
    assert (
        not verdict.valid
        and verdict.file == "stray.bin"
        and "not in the manifest" in verdict.reason
    )
    (path / "stray.bin").unlink()
    (path / "rank_00000.json").unlink()
    verdict = verify(path)
    assert verdict.file == "rank_00000.json" and "missing" in verdict.reason


def test_explicit_invalid_path_raises_with_file_and_reason(two_checkpoints):
    root, _ = two_checkpoints
    path = root / step_dir_name(2)
    (path / "meta.json").write_text("{}")
    model, optim = _model_and_optim()
    with pytest.raises(CheckpointError, match=r"INVALID \(meta.json\): size"):
        CheckpointManager(root).load(model=model, optimizer=optim, path=path)


def test_no_checkpoint_returns_none(tmp_path):
    model, optim = _model_and_optim()
    assert CheckpointManager(tmp_path / "empty").load(model=model, optimizer=optim) is None


def test_retention_keeps_last_n(tmp_path):
    model, optim = _model_and_optim()
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=False)
    for step in range(1, 6):
        manager.save(step, model=model, optimizer=optim, metric=float(10 - step))
    assert [i.step for i in scan(tmp_path)] == [5, 4]


def test_keep_best_by_metric(tmp_path):
    model, optim = _model_and_optim()
    manager = CheckpointManager(tmp_path, keep_last=1, keep_best=1, async_save=False)
    for step, metric in ((1, 3.0), (2, 0.5), (3, 2.0), (4, 1.0)):
        manager.save(step, model=model, optimizer=optim, metric=metric)
    assert sorted(i.step for i in scan(tmp_path)) == [2, 4]


def test_metadata_with_foreign_globals_is_refused(two_checkpoints):
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        safe_load_metadata(pickle.dumps(os.system))
    with pytest.raises(CheckpointError, match="expected DCP Metadata"):
        safe_load_metadata(pickle.dumps({"a": 1}))
    root, _ = two_checkpoints
    reader = SafeFileSystemReader(str(root / step_dir_name(1)))
    assert "0.weight" in str(reader.read_metadata().state_dict_metadata)


def test_cli_verify_and_list(two_checkpoints, capsys):
    root, _ = two_checkpoints
    assert cli_main(["checkpoint", "verify", str(root)]) == 0
    assert "a resume would load" in capsys.readouterr().out
    target = root / step_dir_name(2) / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    assert cli_main(["checkpoint", "verify", str(root / step_dir_name(2))]) == 1
    out = capsys.readouterr().out
    assert "INVALID (__0_0.distcp): SHA-256 mismatch" in out
    assert cli_main(["checkpoint", "verify", str(root)]) == 1
    assert f"a resume would load {root / step_dir_name(1)}" in capsys.readouterr().out
    assert cli_main(["checkpoint", "list", str(root), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(e["step"], e["valid"]) for e in listing] == [(2, False), (1, True)]
    assert cli_main(["checkpoint", "verify", str(root / "nope")]) == 2


def test_background_failure_surfaces_on_wait(tmp_path, monkeypatch):
    model, optim = _model_and_optim()
    manager = CheckpointManager(tmp_path, async_save=True)

    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("torsh_distributed.checkpoint.manifest.write_manifest", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.save(1, model=model, optimizer=optim)
    with pytest.raises(CheckpointError, match="background checkpoint save failed.*No space left"):
        manager.wait()
    assert not scan(tmp_path), "a failed save must not look committed"


def test_intervals_by_steps_and_by_wall_time(tmp_path, monkeypatch):
    by_steps = CheckpointManager(tmp_path / "a", every_steps=3)
    assert [s for s in range(1, 10) if by_steps.due(s)] == [3, 6, 9]
    clock = [100.0]
    monkeypatch.setattr("torsh_distributed.checkpoint.manager.time.monotonic", lambda: clock[0])
    by_time = CheckpointManager(tmp_path / "b", every_s=60.0)
    assert not by_time.due(1)
    clock[0] += 61.0
    assert by_time.due(2)
    model, optim = _model_and_optim()
    by_time.save(2, model=model, optimizer=optim, blocking=True)
    assert not by_time.due(3), "the clock restarts at each save"
    assert CheckpointManager(tmp_path / "c").due(5) is False  # neither interval set
