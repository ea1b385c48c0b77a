"""A tiny model trained from a DeepSpeed config equals the hand-built equivalent, step for step,
on 2 ranks (ZeRO-2, clipping, AdamW betas/eps, WarmupDecayLR); and ``torsh-dist train
--deepspeed`` prints the report, runs, and with ``--strict`` refuses unsupported keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.cli import run_cli

DS = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "steps_per_print": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "betas": [0.85, 0.98], "eps": 1e-7, "weight_decay": 0.05}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-3, "warmup_num_steps": 2, "warmup_type": "linear", "total_num_steps": 6}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
}


def _train(from_deepspeed: bool) -> list[float]:
    from torsh_distributed.compat.deepspeed import import_deepspeed
    from torsh_distributed.engine import Engine
    from torsh_distributed.engine.config import EngineConfig, OptimConfig
    from torsh_distributed.parallel.config import ParallelConfig
    from torsh_distributed.testing import models as M

    if from_deepspeed:
        config, report = import_deepspeed(DS, EngineConfig(progress=False), world_size=2)
        assert not report.unsupported, report.format()
    else:  # the same run written by hand
        config = EngineConfig(
            progress=False,
            max_steps=6,
            batch_size=32,
            grad_accum=2,
            log_every=2,
            optim=OptimConfig(lr=5e-3, beta1=0.85, beta2=0.98, eps=1e-7, weight_decay=0.05, warmup_steps=2,
                              schedule="linear", min_lr_ratio=0.0, grad_clip=0.5),
            parallel=ParallelConfig(zero_stage=2),
        )
    return Engine(M.mlp, dataset=M.classification_data(), config=config).fit().losses


def test_a_deepspeed_config_trains_exactly_like_the_hand_built_one():
    by_hand = run_distributed(_train, 2, args=(False,), timeout=180)[0]
    from_ds = run_distributed(_train, 2, args=(True,), timeout=180)[0]
    assert len(by_hand) == 6
    assert from_ds == by_hand


CLI = ["train"]  # run_cli's arguments: torsh-dist train in a warm process
QUICK = ["--preset", "tiny", "--max-steps", "2", "--eval-batches", "1", "--progress", "false"]


def test_the_cli_reports_every_key_and_strict_refuses(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "gradient_clipping": 0.5, "zero_optimization": {"stage": 0, "overlap_comm": True}}))
    summary = tmp_path / "s.json"
    proc = run_cli([*CLI, *QUICK, "--deepspeed", str(ds), "--summary-json", str(summary)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "DeepSpeed config: 3 applied, 1 mapped, 0 unsupported" in proc.stdout
    assert json.loads(summary.read_text())["steps"] == 2
    # Refusals come before anything runs: the command's own code in this process (an
    # interpreter start each would cost ~3 s).
    from torsh_distributed.cli.main import main

    capfd.readouterr()
    typo: dict[str, Any] = {"train_batch_size": 8, "gradient_clippping": 0.5}
    ds.write_text(json.dumps(typo))
    assert main(["train", *QUICK, "--deepspeed", str(ds), "--strict"]) == 2
    assert "did you mean 'gradient_clipping'" in capfd.readouterr().err
    ds.write_text(json.dumps({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}))
    assert main(["train", *QUICK, "--deepspeed", str(ds), "--lr", "0.1"]) == 2
    assert "--optim.lr 0.1 vs 0.0003 from the DeepSpeed config" in capfd.readouterr().err
