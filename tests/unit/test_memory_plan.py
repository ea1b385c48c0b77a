"""The memory planner (ZeRO formulas, activations), its CLI, and the parallel config's checks."""

from __future__ import annotations

import json

import pytest
import torch

from torsh_distributed.cli.main import main
from torsh_distributed.models.gpt import GPT, Block
from torsh_distributed.parallel.checkpointing import apply_ac, checkpointed_blocks
from torsh_distributed.parallel.config import ParallelConfig, parse_activation_checkpointing
from torsh_distributed.parallel.memory import measure_model_state, peak_rss_bytes, reset_peak_rss
from torsh_distributed.parallel.parallelize import check_world
from torsh_distributed.parallel.sharded import select_units
from torsh_distributed.plan import (
    activation_bytes,
    bytes_per_param,
    model_state_bytes,
    parse_stages,
    plan_memory,
)
from torsh_distributed.train.config import ModelConfig


def test_zero_paper_example_bytes():
    # ZeRO paper, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 (mixed-precision Adam)
    totals = [model_state_bytes(7.5e9, 64, s).total for s in range(4)]
    assert totals == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]


def test_cli_reproduces_the_paper_table(capsys):
    assert main(["plan", "memory", "--params", "7.5e9", "--dp", "64", "--stage", "0..3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "stage" not in line]
    assert [row.split("|")[-2].strip() for row in rows] == [
        "120.0 GB",
        "31.4 GB",
        "16.6 GB",
        "1.9 GB",
    ]


def test_cli_json_one_stage_and_several(capsys):
    main(["plan", "memory", "--params", "1e9", "--dp", "8", "--stage", "3", "--json"])
    one = json.loads(capsys.readouterr().out)
    assert one["model_state_bytes_per_rank"] == {
        "params": 250_000_000,
        "grads": 250_000_000,
        "optimizer": 1_500_000_000,
        "total": 2_000_000_000,
    }
    main(["plan", "memory", "--params", "1e9", "--dp", "8", "--stage", "0..3", "--json"])
    many = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in many["stages"]] == [0, 1, 2, 3]
    assert many["stages"][3]["model_state_bytes_per_rank"] == one["model_state_bytes_per_rank"]
    assert many["inputs"]["dp"] == 8


@pytest.mark.parametrize(
    ("dtype", "optimizer", "expected"),
    [
        ("bf16", "adam", (2, 2, 12)),
        ("fp16", "adam", (2, 2, 12)),
        ("fp32", "adam", (4, 4, 8)),
        ("fp32", "sgd", (4, 4, 4)),
        ("bf16", "sgd", (2, 2, 8)),
        ("fp32", "sgd-plain", (4, 4, 0)),
        ("bf16", "sgd-plain", (2, 2, 4)),
    ],
)
def test_bytes_per_param_variants(dtype, optimizer, expected):
    assert bytes_per_param(dtype, optimizer) == expected


def test_fp32_formulas_per_stage():
    psi, n = 1000, 4
    got = [model_state_bytes(psi, n, s, dtype="fp32").to_dict() for s in range(4)]
    assert [(g["params"], g["grads"], g["optimizer"]) for g in got] == [
        (4000, 4000, 8000),
        (4000, 4000, 2000),
        (4000, 1000, 2000),
        (1000, 1000, 2000),
    ]
    # FSDP2 reshards after backward: stage 2 holds parameter shards between steps
    fsdp2 = model_state_bytes(psi, n, 2, dtype="fp32", layout="fsdp2")
    assert (fsdp2.params, fsdp2.grads, fsdp2.optimizer) == (1000, 1000, 2000)
    # FSDP2's mixed precision keeps fp32 shards: 4 + 4 + 8 per parameter at stage 3
    assert model_state_bytes(psi, n, 3, dtype="bf16", layout="fsdp2").total == 4000


def test_offload_moves_shards_to_host_and_needs_sharding():
    plan = plan_memory(1e9, 8, 3, offload="cpu")
    assert plan.device.total == 0 and plan.host.total == 2_000_000_000
    with pytest.raises(ValueError, match="needs stage 2 or 3"):
        plan_memory(1e9, 8, 1, offload="cpu")


@pytest.mark.parametrize(
    ("text", "stages"), [("2", [2]), ("0..3", [0, 1, 2, 3]), ("0-2", [0, 1, 2]), ("3,1", [1, 3])]
)
def test_parse_stages(text, stages):
    assert parse_stages(text) == stages


def test_parse_stages_rejects_out_of_range():
    with pytest.raises(ValueError, match="must lie in 0..3"):
        parse_stages("2..5")


def test_planner_rejects_bad_inputs():
    with pytest.raises(ValueError, match="stage must be one of"):
        model_state_bytes(1e6, 2, 4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        model_state_bytes(1e6, 2, 1, dtype="int8")


def _saved_bytes(config: ModelConfig, batch: int) -> int:
    torch.manual_seed(0)
    model = GPT(config)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(v for k, v in storages.items() if k not in params)


@pytest.mark.parametrize(
    ("n_layer", "d_model", "n_head", "block_size", "batch"),
    [(2, 64, 2, 64, 4), (3, 96, 4, 32, 2), (1, 128, 8, 128, 3)],
)
def test_activation_formula_matches_saved_tensors(n_layer, d_model, n_head, block_size, batch):
    config = ModelConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, block_size=block_size)
    predicted = activation_bytes(
        n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=block_size, batch=batch
    )
    assert predicted == pytest.approx(_saved_bytes(config, batch), rel=0.01)


def test_activation_checkpointing_shrinks_the_prediction():
    kwargs = {"n_layer": 8, "d_model": 64, "n_head": 2, "seq_len": 64, "batch": 4}
    full = activation_bytes(**kwargs, checkpointed_layers=8)
    half = activation_bytes(**kwargs, checkpointed_layers=4)
    none = activation_bytes(**kwargs)
    assert full < half < none
    with pytest.raises(ValueError, match="checkpointed_layers must be in"):
        activation_bytes(**kwargs, checkpointed_layers=9)


def test_parallel_config_defaults_are_plain_ddp():
    cfg = ParallelConfig()
    assert (cfg.zero_stage, cfg.offload, cfg.param_dtype, cfg.checkpoint_every) == (
        0,
        "none",
        "fp32",
        0,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_stage": 4}, "zero_stage must be one of 0, 1, 2, 3"),
        ({"offload": "cpu"}, "needs zero_stage 2 or 3"),
        ({"zero_stage": 1, "offload": "cpu"}, "needs zero_stage 2 or 3"),
        ({"offload": "disk", "zero_stage": 3}, "offload must be none or cpu"),
        ({"reduce_dtype": "bf16"}, "reduce_dtype='bf16' needs zero_stage 2 or 3"),
        ({"zero_stage": 1, "reduce_dtype": "fp16"}, "DDP, which all-reduces the fp32 gradients"),
        ({"zero_stage": 3, "param_dtype": "int8"}, "param_dtype must be one of"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing must be none, full"),
        ({"activation_checkpointing": "every-0"}, "every-K"),
        ({"wrap": "layer"}, "wrap must be block or size"),
        ({"wrap_min_params": 0}, "wrap_min_params must be >= 1"),
    ],
)
def test_invalid_parallel_settings_say_why(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_activation_checkpointing_spec():
    assert [parse_activation_checkpointing(t) for t in ("none", "full", "every-3")] == [0, 1, 3]


def test_sharding_one_rank_is_rejected():
    with pytest.raises(ValueError, match="there is 1 data-parallel rank"):
        check_world(ParallelConfig(zero_stage=2), 1)
    check_world(ParallelConfig(zero_stage=0), 1)


def test_trainer_flags_reach_the_parallel_section():
    import argparse

    from torsh_distributed.cli.train import add_config_arguments, config_from_args
    from torsh_distributed.train import trainer  # noqa: F401 - the trainer must import cleanly

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--zero-stage", "3", "--offload", "cpu", "--ac", "every-2"])
    cfg = config_from_args(args).parallel
    assert (cfg.zero_stage, cfg.offload, cfg.checkpoint_every) == (3, "cpu", 2)


def test_apply_ac_every_k_and_unit_selection():
    model = GPT(ModelConfig(n_layer=4))
    assert apply_ac(model.blocks, every=2) == 2
    assert checkpointed_blocks(model.blocks) == 2
    # size policy: every block (about 50k params) but not the ModuleList container
    units = select_units(GPT(ModelConfig(n_layer=4)), min_params=40_000)
    assert len(units) == 4 and all(isinstance(u, Block) for u in units)
    with pytest.raises(ValueError, match="exactly one of"):
        select_units(model)


def test_measure_counts_params_grads_and_optimizer_state():
    model = GPT(ModelConfig(n_layer=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (2, 64))
    model(idx, idx)[1].backward()
    opt.step()
    m = measure_model_state(model, opt)
    n = model.num_params()
    assert (m.params.held, m.grads.held, m.optimizer.held) == (4 * n, 4 * n, 8 * n)
    assert m.padding == 0 and m.optimizer_scalars > 0


def test_peak_rss_is_measured_and_resettable():
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here")
    start = peak_rss_bytes()
    assert start > 10_000_000
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    assert peak_rss_bytes() >= start + 60 * 1024 * 1024
    del block
    reset_peak_rss()
    assert peak_rss_bytes() < start + 32 * 1024 * 1024
