"""1-bit Adam and 0/1 Adam without processes: the layouts they cannot serve are refused before
training (naming the alternative), the DeepSpeed types and parameters map onto ours, and on one
rank 1-bit Adam's warm-up is torch's AdamW bit for bit."""

from __future__ import annotations

import pytest
import torch

from torsh_distributed.compat.deepspeed import import_deepspeed
from torsh_distributed.compression.config import CompressionConfig
from torsh_distributed.compression.onebit import OneBitAdam, ZeroOneAdam
from torsh_distributed.engine.config import EngineConfig, OptimConfig
from torsh_distributed.parallel.config import ParallelConfig


@pytest.mark.parametrize(
    ("parallel", "compression", "match"),
    [
        ({"zero_stage": 2}, "none", r"needs --zero-stage 0, got 2 \(or use --optimizer adamw"),
        ({"pp": 2}, "none", r"cannot run with --pp 2 \(or use --optimizer adamw with --compression"),
        ({"tp": 2}, "none", r"cannot run with --tp 2"),
        ({}, "int8", r"compresses its own communication: drop --compression int8"),
    ],
)
def test_layouts_it_cannot_serve_are_refused_with_the_alternative(parallel, compression, match):
    for name in ("onebit_adam", "zerooneadam"):
        with pytest.raises(ValueError, match=match):
            EngineConfig(
                optim=OptimConfig(optimizer=name),
                parallel=ParallelConfig(**parallel),
                compression=CompressionConfig(method=compression),
            )
    EngineConfig(parallel=ParallelConfig(**parallel), compression=CompressionConfig(method=compression))


def test_its_settings_belong_to_its_optimizers():
    with pytest.raises(ValueError, match=r"optim.freeze_step applies to optimizer onebit_adam or zerooneadam only"):
        OptimConfig(freeze_step=5)
    with pytest.raises(ValueError, match=r"optim.var_update_scaler applies to optimizer zerooneadam only"):
        OptimConfig(optimizer="onebit_adam", var_update_scaler=4)
    with pytest.raises(ValueError, match=r"optim.freeze_step must be"):
        OptimConfig(optimizer="onebit_adam", freeze_step=0)
    with pytest.raises(ValueError, match=r"freeze_step must be >= 1"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(3))], freeze_step=0)


def test_deepspeed_types_and_parameters_map_onto_ours():
    ds = {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 7, "var_update_scaler": 4,
                                                          "local_step_scaler": 3, "local_step_clipper": 2,
                                                          "cuda_aware": False, "comm_backend_name": "nccl"}}}
    config, report = import_deepspeed(ds, EngineConfig(), world_size=2)
    o = config.optim
    assert (o.optimizer, o.lr, o.freeze_step, o.var_update_scaler, o.local_step_scaler, o.local_step_clipper) == (
        "zerooneadam", 1e-3, 7, 4, 3, 2)
    assert not report.unsupported
    config, report = import_deepspeed({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 9}}},
                                      EngineConfig(), world_size=2)
    assert (config.optim.optimizer, config.optim.freeze_step) == ("onebit_adam", 9)
    assert {e.key: e.status for e in report.entries}["optimizer.type"] == "mapped"
    # a 1-bit parameter under another type is reported, not applied
    config, report = import_deepspeed({"optimizer": {"type": "AdamW", "params": {"freeze_step": 9}}},
                                      EngineConfig(), world_size=2)
    assert config.optim.freeze_step == 100
    assert "OneBitAdam only" in {e.key: e.note for e in report.unsupported}["optimizer.params.freeze_step"]


def _run(make, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = make(groups)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_one_rank_warm_up_is_torch_adamw_bit_for_bit():
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    ref = _run(lambda g: torch.optim.AdamW(g, foreach=True, **kw), 6)
    ours = _run(lambda g: OneBitAdam(g, freeze_step=6, **kw), 6)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))
    # after the freeze the update differs (frozen variance): the comparison can fail
    frozen = _run(lambda g: OneBitAdam(g, freeze_step=3, **kw), 6)
    assert not all(torch.equal(a, b) for a, b in zip(ref, frozen, strict=True))
    zero_one = _run(lambda g: ZeroOneAdam(g, var_freeze_step=3, **kw), 6)
    assert all(torch.isfinite(p).all() for p in zero_one)


def test_a_factorys_1bit_optimizer_is_refused_on_a_layout_it_cannot_serve():
    from torsh_distributed.compression.onebit import check_layout

    opt = ZeroOneAdam([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"ZeroOneAdam exchanges whole replicas' momenta itself: it needs --zero-stage 0"):
        check_layout(opt, zero_stage=1, model_parallel=False, compressed=False)
    check_layout(opt, zero_stage=0, model_parallel=False, compressed=False)
    check_layout(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]), zero_stage=3, model_parallel=True, compressed=True)
