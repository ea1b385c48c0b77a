"""Mixed-precision settings, autocast for DDP stages, and the loss scaler in one process."""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch

from torsh_distributed.models.gpt import GPT
from torsh_distributed.parallel.config import ParallelConfig
from torsh_distributed.parallel.precision import LossScaler, apply_autocast, needs_grad_scaling
from torsh_distributed.train.config import ModelConfig


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_and_bf16_compute_are_accepted_at_every_stage(stage):
    for dtype in ("fp16", "bf16"):
        assert ParallelConfig(zero_stage=stage, param_dtype=dtype).param_dtype == dtype


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_stage": 0, "reduce_dtype": "fp16"}, "reduce_dtype='fp16' needs zero_stage 2 or 3"),
        ({"zero_stage": 1, "reduce_dtype": "bf16"}, "use --compression bf16"),
        (
            {"param_dtype": "fp16", "loss_scale_init": 0.0},
            "loss_scale_init must be a finite number > 0",
        ),
        ({"param_dtype": "fp16", "loss_scale_init": float("inf")}, "finite number > 0, got inf"),
        ({"param_dtype": "fp16", "loss_scale_growth_interval": 0}, "growth_interval must be >= 1"),
        ({"tp": 2, "param_dtype": "fp16"}, "fp16 needs loss scaling, which does not combine with tp/pp > 1"),
    ],
)
def test_invalid_precision_settings_say_why(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_loss_scale_settings_without_fp16_warn():
    with pytest.warns(UserWarning, match="only used with param_dtype or reduce_dtype fp16"):
        ParallelConfig(zero_stage=3, param_dtype="bf16", loss_scale_init=1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParallelConfig(param_dtype="fp16", loss_scale_init=1024.0)


def test_scaling_is_needed_exactly_when_fp16_is_used():
    assert needs_grad_scaling(ParallelConfig(param_dtype="fp16"))
    assert needs_grad_scaling(ParallelConfig(zero_stage=2, reduce_dtype="fp16"))
    assert not needs_grad_scaling(ParallelConfig(zero_stage=2, param_dtype="bf16"))
    assert not needs_grad_scaling(ParallelConfig())


def test_autocast_runs_matmuls_in_fp16_keeps_names_and_fp32_loss():
    torch.manual_seed(0)
    model = GPT(ModelConfig())
    names = list(model.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    _, reference = model(idx, idx)
    apply_autocast(model, dtype="fp16", device_type="cpu")
    logits, loss = model(idx, idx)
    assert logits.dtype == torch.float16  # the head is a matmul: autocast's fp16 list
    assert loss.dtype == torch.float32  # cross-entropy is on the fp32 list
    assert loss.item() == pytest.approx(reference.item(), rel=1e-2)
    assert loss.item() != reference.item()
    assert list(model.state_dict()) == names
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    with pytest.raises(ValueError, match="autocast dtype must be bf16 or fp16"):
        apply_autocast(model, dtype="fp32", device_type="cpu")


@pytest.mark.parametrize(
    "scaler",
    [
        pytest.param(lambda: LossScaler(enabled=False, device="cpu"), id="explicit"),
        pytest.param(lambda: LossScaler.from_config(ParallelConfig(), device="cpu"), id="config"),
    ],
)
def test_disabled_scaler_is_plain_backward_and_step(scaler):
    scaler = scaler()
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler.backward((param * 2).sum())
    scaler.unscale(optimizer)
    assert scaler.step(optimizer) is True
    assert torch.equal(param.detach(), torch.zeros(3))
    assert scaler.enabled is False
    assert scaler.scale == 1.0 and scaler.summary() == {} and scaler.state_dict() == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 0.0}, "init_scale must be a finite number > 0, got 0.0"),
        ({"init_scale": float("nan")}, "init_scale must be a finite number > 0, got nan"),
        ({"init_scale": float("inf")}, "init_scale must be a finite number > 0, got inf"),
        ({"growth_interval": 0}, "growth_interval must be >= 1, got 0"),
    ],
)
def test_explicit_scaler_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(device="cpu", **kwargs)


def test_from_config_takes_the_sections_settings_and_describes_its_dtypes():
    config = ParallelConfig(param_dtype="fp16", loss_scale_init=512.0, loss_scale_growth_interval=3)
    scaler = LossScaler.from_config(config, device=torch.device("cpu"))
    assert scaler.enabled and scaler.scale == 512.0
    assert scaler.state_dict()["growth_interval"] == 3
    assert scaler.summary() == {
        "param_dtype": "fp16",
        "reduce_dtype": "fp32",
        "compute": "autocast",
        "loss_scaling": True,
        "loss_scale": 512.0,
        "skipped_steps": 0,
        "skipped_at": [],
    }
    # bf16 needs no scaling, but the run summary still says which dtypes it used
    bf16 = LossScaler.from_config(ParallelConfig(zero_stage=3, param_dtype="bf16"), device="cpu")
    assert bf16.summary() == {
        "param_dtype": "bf16",
        "reduce_dtype": "fp32",
        "compute": "fsdp2",
        "loss_scaling": False,
    }
    # built directly, the summary reports only what the scaler itself knows
    direct = LossScaler(enabled=True, device="cpu", init_scale=8.0)
    assert direct.summary() == {
        "loss_scaling": True, "loss_scale": 8.0, "skipped_steps": 0, "skipped_at": []
    }


def test_overflow_skips_the_step_and_backs_the_scale_off():
    # no process group: torch's plain GradScaler (nobody to agree with)
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.5)
    config = ParallelConfig(param_dtype="fp16", loss_scale_init=2.0**127)
    scaler = LossScaler.from_config(config, device=torch.device("cpu"))
    scaler.backward((param * 4).sum())  # 4 * 2**127 overflows fp32
    scaler.unscale(optimizer)
    assert scaler.step(optimizer) is False
    assert torch.equal(param.detach(), torch.ones(3))
    assert scaler.scale == 2.0**126
    optimizer.zero_grad()
    scaler.backward((param * 2).sum())  # 2 * 2**126 fits: unscaled gradient is exactly 2
    scaler.unscale(optimizer)
    assert torch.equal(param.grad, torch.full((3,), 2.0))
    assert scaler.step(optimizer) is True
    assert torch.equal(param.detach(), torch.zeros(3))
    summary = scaler.summary()
    assert (summary["skipped_steps"], summary["skipped_at"]) == (1, [1])
    assert summary["loss_scale"] == 2.0**126 and summary["compute"] == "autocast"
    restored = LossScaler(enabled=True, device="cpu")  # the scale comes from the state
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 2.0**126


def test_loss_scale_flags_reach_the_parallel_section():
    from torsh_distributed.cli.train import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(
        [
            "--zero-stage",
            "3",
            "--param-dtype",
            "fp16",
            "--loss-scale-init",
            "1024",
            "--loss-scale-growth-interval",
            "50",
        ]
    )
    cfg = config_from_args(args).parallel
    assert (cfg.param_dtype, cfg.loss_scale_init, cfg.loss_scale_growth_interval) == (
        "fp16",
        1024.0,
        50,
    )
