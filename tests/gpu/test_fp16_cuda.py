"""fp16 on CUDA: autocast + DDP at one rank, FSDP2 fp16 with loss scaling at two GPUs (NCCL).

Skipped without CUDA; not yet run on a GPU (none was available when it was written). The same
paths are tested on Gloo/CPU in tests/distributed/test_fp16_scaling.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]


def _config(parallel: dict) -> dict:
    cfg = preset("tiny")
    cfg.max_steps = 8
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 300_000
    data = cfg.to_dict()
    data["parallel"] = parallel
    return data


def _train(data: dict) -> dict:
    result = train(TrainConfig.from_dict(json.loads(json.dumps(data))))
    return {"losses": result.losses, "precision": result.precision, "backend": result.backend}


def test_ddp_autocast_fp16_on_one_gpu():
    fp32 = run_distributed(_train, 1, args=(_config({}),), backend="nccl", timeout=180)[0]
    fp16 = run_distributed(
        _train, 1, args=(_config({"param_dtype": "fp16"}),), backend="nccl", timeout=180
    )[0]
    assert fp16["backend"] == "nccl"
    assert fp16["precision"]["compute"] == "autocast"
    assert fp16["precision"]["skipped_steps"] == 0
    for a, b in zip(fp32["losses"], fp16["losses"], strict=True):
        assert b == pytest.approx(a, rel=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_fp16_overflow_is_skipped_on_both_gpus():
    parallel = {"zero_stage": 3, "param_dtype": "fp16", "loss_scale_init": 2.0**17}
    results = run_distributed(_train, 2, args=(_config(parallel),), backend="nccl", timeout=180)
    assert results[0] == results[1]
    precision = results[0]["precision"]
    assert precision["skipped_at"] == [1, 2]
    assert precision["loss_scale"] == 2.0**15
