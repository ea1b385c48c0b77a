"""Gradient compression in the model-parallel loop (dp x tp x pp, 4 ranks).

The ``dp`` exchange of the local gradient shards runs through the same hook state as DDP's:

* dp2 x tp2 with fp16 follows uncompressed training to fp16 rounding and sends half the bytes;
  powersgd:2 (matrices of the local TP shards) sends less and trains;
* dp2 x tp2 with topk:0.1 (which selects over the whole flat tensor, different TP shards on each
  tp rank): the replicated parameters' gradients are equal on both tp ranks at every step;
* dp2 x pp2 with topk:0.1: 2N steps straight == N steps, resume, N steps, bit for bit (the
  residuals are in the checkpoint: without them the resumed steps differ).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh_distributed.checkpoint import step_dir_name
from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.configs import small_config, with_checkpoints
from torsh_distributed.train import TrainConfig, train

N = 3

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _config(method: str, parallel: dict, directory: Path | None = None, **checkpoint) -> TrainConfig:
    cfg = small_config(2 * N)
    cfg.compression.method = method
    if directory is not None:
        with_checkpoints(cfg, directory, every=N, **checkpoint)
    data = cfg.to_dict()
    data["parallel"] = parallel
    return TrainConfig.from_dict(data)


def _replica_gaps(method: str, parallel: dict) -> list[float]:
    """Per step: the largest difference between tp ranks of a replicated parameter's gradient,
    taken just before clipping (after the data-parallel exchange)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from torsh_distributed.engine import _run as _trainer_mp

    gaps: list[float] = []
    clip = _trainer_mp.clip_grad_norm_

    def checked(params, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        params = list(params)
        local = [
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).reshape(-1)
            for p in params
            if p.grad is not None
            and not (isinstance(p, DTensor) and any(isinstance(x, Shard) for x in p.placements))
        ]
        flat = torch.cat(local)
        high, low = flat.clone(), flat.clone()
        mesh = next(p.device_mesh for p in params if isinstance(p, DTensor))  # the tp mesh
        group = mesh.get_group()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        gaps.append(float((high - low).max()))
        return clip(params, *args, **kwargs)

    _trainer_mp.clip_grad_norm_ = checked
    try:
        train(_config(method, parallel))
    finally:
        _trainer_mp.clip_grad_norm_ = clip
    return gaps


def _cases(root: str) -> dict:
    base, out = Path(root), {}
    tp = {"dp": 2, "tp": 2}
    for method in ("none", "fp16", "powersgd:2"):
        r = train(_config(method, tp))
        out[method] = (r.losses, r.compression)
    out["replicas"] = _replica_gaps("topk:0.1", tp)
    pp = {"dp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2}
    straight = train(_config("topk:0.1", pp, base / "a"))
    half = base / "a" / step_dir_name(N)
    resumed = train(_config("topk:0.1", pp, base / "b", resume=str(half)))
    out["topk"] = (straight.losses, resumed.losses, straight.compression)
    return out


def test_compression_in_the_model_parallel_loop(tmp_path):
    r = run_distributed(_cases, 4, args=(str(tmp_path),), timeout=400)[0]
    none, _ = r["none"]
    fp16, fp16_c = r["fp16"]
    assert fp16 == pytest.approx(none, rel=1e-3)
    assert fp16_c["method"] == "fp16" and fp16_c["ratio"] == pytest.approx(2.0, rel=1e-3)
    assert fp16_c["steps"] == 2 * N
    psgd, psgd_c = r["powersgd:2"]
    assert psgd_c["bytes_sent"] < psgd_c["bytes_uncompressed"] / 2
    assert psgd[-1] < psgd[0]
    gaps = r["replicas"]
    assert len(gaps) == 2 * N and max(gaps) == 0.0, f"replicated gradients differ over tp: {gaps}"
    straight, resumed, topk_c = r["topk"]
    assert topk_c["ratio"] > 2 and topk_c["steps"] == 2 * N
    assert resumed == straight, "losses differ after resuming with the compressor state"
