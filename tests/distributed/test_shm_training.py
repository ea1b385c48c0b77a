"""Training on ``gloo+shm`` equals training on Gloo: DDP, ZeRO-2 and ZeRO-3 (FSDP2) through the
built-in trainer, 2 ranks, a tiny model, 3 steps; the per-step losses agree within 1e-5 (relative)
and the default group's all-reduces really took the shared-memory path. ``backend="auto"`` picks
``gloo+shm`` for several ranks of one host, and falls back to Gloo where it cannot run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.testing import RankFailedError, run_distributed
from torsh_distributed.train import TrainConfig, preset, train

VARIANTS = {"ddp": {}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}


def _config() -> dict:
    cfg = preset("tiny")
    cfg.max_steps = 3
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 200_000
    cfg.model.n_layer = 2
    return cfg.to_dict()


def _train_variants(config: dict) -> dict:
    out = {}
    for name, parallel in VARIANTS.items():
        data = json.loads(json.dumps(config))
        data["parallel"] = parallel
        out[name] = train(TrainConfig.from_dict(data)).losses  # adopts the harness's group
    counts = getattr(dist.group.WORLD, "counts", {})
    out["shm_calls"] = sum(v for k, v in counts.items() if k.startswith("shm"))
    out["backend"] = dist.get_backend()
    return out


def test_ddp_zero2_zero3_on_gloo_shm_equal_gloo():
    config = _config()
    shm = run_distributed(_train_variants, 2, args=(config,), backend="gloo+shm", timeout=240)
    gloo = run_distributed(_train_variants, 2, args=(config,), backend="gloo", timeout=240)
    assert shm[0]["backend"] == "gloo+shm" and gloo[0]["backend"] == "gloo"
    assert shm[0]["shm_calls"] > 0
    for name in VARIANTS:
        assert shm[0][name] == shm[1][name], f"{name}: ranks disagree"
        assert gloo[0][name][-1] < gloo[0][name][0] or name != "ddp"
        assert shm[0][name] == pytest.approx(gloo[0][name], rel=1e-5), name


def _auto_choice() -> dict:
    t = torch.full((70_000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    pg = dist.group.WORLD
    return {
        "backend": dist.get_backend(),
        "sum": t[0].item(),
        "shm": pg._transport is not None if hasattr(pg, "_transport") else None,
        "counts": dict(getattr(pg, "counts", {})),
    }


def test_auto_picks_gloo_shm_for_local_ranks_and_falls_back_without_room():
    # two ranks on this host, a compiler here: `auto` chooses the shared-memory backend
    auto = run_distributed(_auto_choice, 2, backend="auto", timeout=120)
    assert [r["backend"] for r in auto] == ["gloo+shm", "gloo+shm"]
    assert all(r["shm"] and r["counts"].get("shm allreduce") == 1 for r in auto)
    assert auto[0]["sum"] == 3.0
    # no C helper: `auto` stays on Gloo
    plain = run_distributed(_auto_choice, 2, backend="auto", env={"TORSH_SHM_NO_CC": "1"})
    assert [r["backend"] for r in plain] == ["gloo", "gloo"]
    # a segment larger than /dev/shm can hold: chosen by `auto`, the group runs on Gloo (and
    # says so); asked for by name, init fails naming /dev/shm
    huge = {"TORSH_SHM_SLOT_BYTES": str(1 << 50)}
    roomless = run_distributed(_auto_choice, 2, backend="auto", env=huge, timeout=120)
    assert [r["backend"] for r in roomless] == ["gloo+shm", "gloo+shm"]
    assert all(not r["shm"] and r["counts"].get("gloo allreduce") == 1 for r in roomless)
    assert roomless[1]["sum"] == 3.0
    with pytest.raises(RankFailedError, match="/dev/shm"):
        run_distributed(_auto_choice, 2, backend="gloo+shm", env=huge, timeout=120)


def test_auto_resolution_rules(monkeypatch):
    from torsh_distributed.runtime import shm
    from torsh_distributed.runtime.world import resolve_backend

    try:
        assert resolve_backend("auto", local_world_size=1) == "gloo"  # nothing to share
        assert resolve_backend("auto", local_world_size=4) == "gloo+shm"
        monkeypatch.setenv("TORSH_SHM_NO_CC", "1")
        assert resolve_backend("auto", local_world_size=4) == "gloo"
    finally:
        shm.set_lenient(False)
