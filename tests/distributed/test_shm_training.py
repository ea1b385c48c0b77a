"""Training on ``gloo+shm`` equals training on Gloo: DDP, ZeRO-2 and ZeRO-3 (FSDP2) through the
built-in trainer, 2 ranks, a tiny model, 3 steps; the per-step losses agree within 1e-5 (relative)
and the default group's all-reduces really took the shared-memory path."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from torsh_distributed.testing import run_distributed
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
