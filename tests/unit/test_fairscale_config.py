"""FairScale set-ups (OSS, ShardedDataParallel, FullyShardedDataParallel arguments, fairseq's
distributed_training section) mapped onto our ZeRO stages, every key reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torsh_distributed.compat.fairscale import import_fairscale
from torsh_distributed.engine.config import EngineConfig
from torsh_distributed.parallel.config import ParallelConfig
from torsh_distributed.testing.cli import run_cli


def _import(spec: dict, strict: bool = False):
    return import_fairscale(spec, EngineConfig(), strict=strict)


def test_oss_with_sharded_data_parallel_is_zero2():
    config, report = _import(
        {
            "OSS": {"optim": "torch.optim.AdamW", "lr": 1e-3, "betas": [0.9, 0.98], "eps": 1e-6, "broadcast_buffer_size": 2**17},
            "ShardedDataParallel": {"reduce_fp16": True, "sync_models_at_startup": True},
        }
    )
    assert config.parallel.zero_stage == 2 and config.parallel.reduce_dtype == "fp16"
    assert (config.optim.optimizer, config.optim.lr, config.optim.beta2, config.optim.eps) == ("adamw", 1e-3, 0.98, 1e-6)
    assert not report.unsupported
    assert len(report.entries) == 7  # every argument reported


def test_oss_alone_is_zero1_and_fsdp_maps_its_arguments():
    config, _ = _import({"OSS": {"optim": "SGD", "lr": 0.1, "momentum": 0.9}})
    assert config.parallel.zero_stage == 1 and config.optim.optimizer == "sgd" and config.optim.momentum == 0.9
    config, report = _import(
        {"FullyShardedDataParallel": {"reshard_after_forward": False, "mixed_precision": True, "fp32_reduce_scatter": True,
                                      "move_params_to_cpu": True, "flatten_parameters": True, "bucket_cap_mb": 25}}
    )
    p = config.parallel
    assert (p.zero_stage, p.param_dtype, p.reduce_dtype, p.offload) == (2, "fp16", "fp32", "cpu")
    status = {e.key: e.status for e in report.entries}
    assert status["FullyShardedDataParallel.flatten_parameters"] == "mapped"
    assert status["FullyShardedDataParallel.reshard_after_forward"] == "applied"
    # the same config as writing it by hand
    assert config == EngineConfig(parallel=ParallelConfig(zero_stage=2, param_dtype="fp16", reduce_dtype="fp32", offload="cpu"))


def test_fairseq_sections_map_onto_the_stages():
    cfg = {
        "distributed_training": {"no_reshard_after_forward": True, "ddp_backend": "fully_sharded", "cpu_offload": False,
                                 "distributed_world_size": 8, "heartbeat_timeout": -1},
        "common": {"fp16": True, "log_interval": 100},
        "optimization": {"clip_norm": 0.5, "lr": [5e-4], "update_freq": [4], "max_update": 1000},
    }
    config, report = _import(cfg)
    assert config.parallel.zero_stage == 2 and config.parallel.param_dtype == "fp16"
    assert (config.optim.grad_clip, config.optim.lr, config.grad_accum, config.max_steps) == (0.5, 5e-4, 4, 1000)
    unsupported = {e.key for e in report.unsupported}
    assert unsupported == {"distributed_training.heartbeat_timeout", "common.log_interval"}
    config, _ = _import({"distributed_training": {"ddp_backend": "c10d", "zero_sharding": "os"}})
    assert config.parallel.zero_stage == 1


def test_unknown_arguments_are_named_and_strict_refuses_them():
    _, report = _import({"FullyShardedDataParallel": {"reshard_after_fwd": True, "mixed_precison": True}})
    notes = {e.key: e.note for e in report.unsupported}
    assert "did you mean 'mixed_precision'" in notes["FullyShardedDataParallel.mixed_precison"]
    with pytest.raises(ValueError, match="--strict: unsupported FairScale config keys"):
        _import({"FullyShardedDataParallel": {"offload_config": {"offload_type": "ssd_offload"}}}, strict=True)
    with pytest.raises(ValueError, match="names OSS, ShardedDataParallel or FullyShardedDataParallel"):
        _import({"fsdp": {}})


def test_the_cli_prints_the_report(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    spec = tmp_path / "fs.json"
    spec.write_text(json.dumps({"distributed_training": {"ddp_backend": "pytorch_ddp"}, "optimization": {"clip_norm": 0.25}}))
    args = ["train", "--preset", "tiny", "--max-steps", "1", "--eval-batches", "1", "--progress", "false",
            "--fairscale", str(spec)]
    proc = run_cli(args, timeout=120)  # a warm process (torsh_distributed.testing.cli)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FairScale config: 1 applied, 1 mapped, 0 unsupported" in proc.stdout
    # refused before anything runs: the command's own code in this process
    from torsh_distributed.cli.main import main

    capfd.readouterr()
    assert main([*args, "--deepspeed", str(spec)]) == 2
    assert "give --deepspeed or --fairscale, not both" in capfd.readouterr().err
