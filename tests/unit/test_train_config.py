"""Trainer configuration: presets, validation, CLI flag mapping."""

from __future__ import annotations

import argparse

import pytest

from torsh_distributed.cli.train import add_config_arguments, config_from_args
from torsh_distributed.engine.optim import lr_at
from torsh_distributed.train.config import ModelConfig, TrainConfig, preset


def _parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_presets_differ_and_validate():
    tiny, small = preset("tiny"), preset("small")
    assert tiny.model.n_layer < small.model.n_layer
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of tiny, small"):
        preset("huge")


def test_flags_override_preset():
    cfg = _parse("--preset", "tiny", "--max-steps", "7", "--lr", "0.01", "--model.n-layer", "3",
                 "--batch-size", "8", "--progress", "false")
    assert (cfg.max_steps, cfg.optim.lr, cfg.model.n_layer, cfg.batch_size) == (7, 0.01, 3, 8)
    assert cfg.progress is False
    assert cfg.model.d_model == preset("tiny").model.d_model


def test_shared_field_names_have_section_flags_and_the_bare_spelling_names_the_choices(capsys):
    cfg = _parse("--optim.warmup-steps", "3", "--compression.warmup-steps", "5")
    assert (cfg.optim.warmup_steps, cfg.compression.warmup_steps) == (3, 5)
    assert _parse("--compression-warmup", "4").compression.warmup_steps == 4
    for argv in (["--warmup-steps", "3"], ["--warmup-steps=3"], ["--warmup-steps"]):
        with pytest.raises(SystemExit) as exit_info:
            _parse(*argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert (
            "error: --warmup-steps is ambiguous: 2 sections have this setting; use "
            "--optim.warmup-steps (steps of linear warm-up from 0 to lr) or "
            "--compression.warmup-steps / --compression-warmup (exchange uncompressed gradients "
            "for the first N steps, then compress)"
        ) in err
    with pytest.raises(SystemExit):
        _parse("--every", "5")
    err = capsys.readouterr().err
    assert "--every is ambiguous: 3 sections have this setting; use --checkpoint.every" in err
    assert "--monitor.every / --monitor-every" in err and "--moe.every" in err
    assert _parse("--trace", "t.json").comm.trace == "t.json"  # claimed by one section: kept


def test_json_round_trip():
    cfg = _parse("--seed", "9")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown config keys"):
        TrainConfig.from_dict({"nope": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 30, "n_head": 4}, r"model.d_model \(30\) must be divisible by model.n_head \(4\)"),
        ({"n_layer": 0}, "model.n_layer must be > 0"),
        ({"dropout": 1.0}, r"model.dropout must be in \[0, 1\)"),
    ],
)
def test_model_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_invalid_flag_value_is_reported():
    with pytest.raises(ValueError, match="train.max_steps must be > 0, got 0"):
        _parse("--max-steps", "0")


def test_global_batch_must_divide():
    cfg = TrainConfig(batch_size=30)
    assert cfg.check_world(3) == 10
    with pytest.raises(ValueError, match="batch_size 30 .* not divisible by the 4 data-parallel ranks"):
        cfg.check_world(4)


def test_lr_schedule_warmup_then_cosine():
    optim = preset("tiny").optim
    assert lr_at(0, optim=optim, max_steps=100) == pytest.approx(optim.lr / optim.warmup_steps)
    assert lr_at(optim.warmup_steps - 1, optim=optim, max_steps=100) == pytest.approx(optim.lr)
    assert lr_at(100, optim=optim, max_steps=100) == pytest.approx(optim.lr * optim.min_lr_ratio)
    values = [lr_at(s, optim=optim, max_steps=100) for s in range(optim.warmup_steps, 100)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_optimizer_flags_build_sgd_and_invalid_ones_are_named():
    import torch

    from torsh_distributed.engine._memory import planner_optimizer
    from torsh_distributed.engine.optim import build_optimizer as _optimizer
    from torsh_distributed.train.config import OptimConfig

    cfg = _parse("--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.5")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = _optimizer(model, cfg.optim)
    assert isinstance(opt, torch.optim.SGD)
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.9]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]  # matrices only
    assert isinstance(_optimizer(model, _parse().optim), torch.optim.AdamW)
    assert planner_optimizer(cfg.optim) == "sgd"
    assert planner_optimizer(OptimConfig(optimizer="sgd")) == "sgd-plain"
    assert planner_optimizer(OptimConfig()) == "adam"
    with pytest.raises(ValueError, match="optim.optimizer must be one of adamw, sgd, onebit_adam, zerooneadam, got 'lion'"):
        OptimConfig(optimizer="lion")
    with pytest.raises(ValueError, match=r"optim.momentum must be in \[0, 1\), got 1.0"):
        OptimConfig(optimizer="sgd", momentum=1.0)
    with pytest.raises(ValueError, match="applies to optimizer 'sgd' only"):
        OptimConfig(momentum=0.9)


def test_ddp_options_are_warned_as_ignored_without_ddp():
    from torsh_distributed.parallel.config import ParallelConfig

    with pytest.warns(UserWarning, match=r"parallel.static_graph are DDP's options and are ignored with FSDP2"):
        ParallelConfig(zero_stage=3, static_graph=True)
    with pytest.warns(UserWarning, match=r"bucket_cap_mb are DDP's options and are ignored with tp/pp > 1"):
        ParallelConfig(tp=2, bucket_cap_mb=5)
    with pytest.raises(ValueError, match="parallel.pp_split names 2 split points; pp=2 x virtual_stages=1"):
        ParallelConfig(pp=2, pp_split="layers.2,layers.4")
    with pytest.raises(ValueError, match="parallel.pp_split='layers.2' needs parallel.pp > 1"):
        ParallelConfig(pp_split="layers.2")
    with pytest.raises(ValueError, match="fp16 needs loss scaling, which does not combine with tp/pp"):
        ParallelConfig(tp=2, param_dtype="fp16")
