"""The engine's paths on one CUDA device: NCCL at world size 1, so FSDP2, the loss scaler,
checkpoint staging, MoE and the memory report run on CUDA tensors (DDP is not built for one data-
parallel rank: its reducer and our compression hooks run over Gloo with CUDA tensors in
test_codecs_cuda.py). Skipped without CUDA; `make gpu-check` (docs/gpu.md) runs them on the device machine.

Multi-rank TP/PP need two GPUs under NCCL (NCCL refuses two ranks on one device): those tests
skip with that reason on a one-GPU host.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from torsh_distributed.testing import run_distributed
from torsh_distributed.train import TrainConfig, preset, train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]


def _config(steps: int = 12, **sections: dict) -> dict:
    cfg = preset("tiny")
    cfg.max_steps = steps
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 300_000
    data = cfg.to_dict()
    for name, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(name, {}).update(values)
        else:
            data[name] = values
    return data


def _train(data: dict) -> dict:
    result = train(TrainConfig.from_dict(json.loads(json.dumps(data))))
    out = result.summary()
    out["losses"] = result.losses
    return out


def _run(data: dict) -> dict:
    return run_distributed(_train, 1, args=(data,), backend="nccl", timeout=240)[0]


@pytest.fixture(scope="module")
def reference() -> dict:
    """The plain fp32 DDP run every other run is compared with."""
    return _run(_config())


def _close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert math.isfinite(y)
        assert y == pytest.approx(x, rel=rel)


def test_reference_runs_on_nccl_and_learns(reference: dict):
    assert reference["backend"] == "nccl"
    assert reference["memory"]["cuda_max_allocated_bytes"] > 0  # the model trained on the GPU
    assert reference["final_loss"] < reference["initial_loss"] - 0.5


def _fsdp_steps(stage: int, dtype: str, ac: bool) -> tuple[list[float], list[float]]:
    """FSDP2 through :func:`apply_fsdp` (and :func:`apply_ac`) on the one GPU, mesh of one rank
    (the engine refuses ZeRO with one data-parallel rank; the library functions do not), beside
    the same model unsharded in fp32; returns both runs' losses."""
    import copy

    from torsh_distributed.comm.dims import ParallelDims
    from torsh_distributed.models.config import ModelConfig
    from torsh_distributed.models.gpt import GPT
    from torsh_distributed.parallel.checkpointing import apply_ac
    from torsh_distributed.parallel.sharded import apply_fsdp

    dims = ParallelDims(dp=1, device_type="cuda").build()
    torch.manual_seed(0)
    ref = GPT(ModelConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)).cuda()
    model = copy.deepcopy(ref)
    if ac:
        assert apply_ac(model.blocks, every=1) == 4
    apply_fsdp(model, dims.data_mesh(), stage=stage, units=list(model.blocks), param_dtype=dtype)
    assert any(type(p).__name__ == "DTensor" for p in model.parameters())
    out: tuple[list[float], list[float]] = ([], [])
    # learnable rows: token t+1 = token t + stride (mod 256), a random start and stride per row
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 256, (10, 8, 1), generator=g)
    stride = torch.randint(1, 4, (10, 8, 1), generator=g)
    data = ((start + stride * torch.arange(65)) % 256).cuda()
    for net, losses in zip((ref, model), out, strict=True):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        for rows in data:
            logits = net(rows[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     rows[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp2_bf16_with_activation_checkpointing(stage: int):
    ref, sharded = run_distributed(_fsdp_steps, 1, args=(stage, "bf16", True), backend="nccl",
                                   timeout=240)[0]
    _close(ref, sharded, rel=3e-2)
    assert sharded[-1] < sharded[0] - 0.3


def test_fsdp2_fp32_matches_unsharded():
    ref, sharded = run_distributed(_fsdp_steps, 1, args=(3, "fp32", False), backend="nccl",
                                   timeout=240)[0]
    _close(ref, sharded, rel=1e-4)


def test_fp16_loss_scaler_skips_overflowing_steps(reference: dict):
    parallel = {"param_dtype": "fp16", "loss_scale_init": 2.0**24}
    out = _run(_config(parallel=parallel))
    precision = out["precision"]
    assert precision["skipped_steps"] >= 1  # 2**24 overflows fp16 gradients: skipped, halved
    assert precision["skipped_steps"] < len(out["losses"])  # until the scale fits
    assert precision["loss_scale"] < 2.0**24
    assert all(math.isfinite(v) for v in out["losses"])
    assert out["final_loss"] < out["initial_loss"]  # the steps taken trained the model


def test_async_checkpoint_from_cuda_and_resume(tmp_path: Path):
    straight = _run(_config(steps=12))
    ckpt = {"dir": str(tmp_path / "ck"), "every": 6, "async_save": True, "resume": "never"}
    first = _run(_config(steps=6, checkpoint=ckpt))
    assert first["checkpoint"]["saves"] >= 1
    resumed = _run(_config(steps=12, checkpoint={**ckpt, "resume": "auto"}))
    assert resumed["checkpoint"].get("resumed_step") == 6
    # the resumed run's steps 7..12 are the straight run's (same data position, RNG, optimizer)
    _close(straight["losses"][6:], resumed["losses"][-6:], rel=1e-4)


def test_moe_layers_on_cuda():
    out = _run(_config(moe={"num_experts": 4, "top_k": 2}))
    assert out["moe"], "no MoE statistics: the experts did not run"
    assert out["final_loss"] < out["initial_loss"] - 0.5


def test_meta_init_materialises_on_cuda(reference: dict):
    # built on ``meta`` and materialised on the GPU: initialised by the CUDA generator, so the
    # weights (and losses) differ from the CPU-initialised reference, not the start or the trend
    out = _run(_config(parallel={"meta_init": True}))
    assert out["backend"] == "nccl"
    assert out["initial_loss"] == pytest.approx(reference["initial_loss"], rel=0.02)
    assert out["final_loss"] < out["initial_loss"] - 0.5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP/PP under NCCL need 2 GPUs")
def test_tp2_and_pp2_on_two_gpus(reference: dict):
    tp = run_distributed(_train, 2, args=(_config(parallel={"tp": 2}),), backend="nccl",
                         timeout=240)[0]
    _close(reference["losses"], tp["losses"], rel=1e-3)
    pp = run_distributed(_train, 2, args=(_config(parallel={"pp": 2}),), backend="nccl",
                         timeout=240)[0]
    _close(reference["losses"], pp["losses"], rel=1e-3)


def test_memory_planner_vs_cuda_max_allocated():
    """The planner's predicted peak (model states + transient + activations + optimizer
    temporary, i.e. the predicted peak minus the process baseline) vs
    ``torch.cuda.max_memory_allocated`` on a model large enough that states dominate."""
    out = _run(
        _config(steps=3, model={"n_layer": 4, "d_model": 512, "n_head": 8, "block_size": 128})
    )
    memory = out["memory"]
    measured = memory["cuda_max_allocated_bytes"]
    predicted = memory["predicted_peak_rss_bytes"] - memory["baseline_rss_bytes"]
    print(f"planner predicted {predicted} B, cuda max allocated {measured} B, "
          f"ratio {predicted / measured:.3f}")
    assert predicted == pytest.approx(measured, rel=0.10)
