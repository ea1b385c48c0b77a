"""Checkpoint config and CLI flags, retention rules, RNG/data-position state, fault specs."""

from __future__ import annotations

import random
import signal

import numpy as np
import pytest
import torch

from torsh_distributed.checkpoint import CheckpointConfig, faults
from torsh_distributed.checkpoint.resume import (
    capture_rng,
    check_data_position,
    data_position,
    restore_rng,
)
from torsh_distributed.checkpoint.retention import to_delete
from torsh_distributed.cli.main import build_parser
from torsh_distributed.cli.train import config_from_args
from torsh_distributed.data.corpus import sample_batch
from torsh_distributed.engine._checkpoint import computation_settings, settings_hash
from torsh_distributed.runtime.errors import CheckpointError
from torsh_distributed.train import preset


def test_defaults_keep_checkpointing_off():
    cfg = preset("tiny")
    assert not cfg.checkpoint.enabled and cfg.checkpoint.resume == "auto"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": -1}, "checkpoint.every must be >= 0"),
        ({"every_s": -2.0}, "checkpoint.every_s must be >= 0"),
        ({"keep_last": -1}, "checkpoint.keep_last must be >= 0"),
        ({"keep_best": -1}, "checkpoint.keep_best must be >= 0"),
        ({"resume": ""}, "checkpoint.resume must be auto, never or a checkpoint path"),
        ({"every": 5}, "need checkpoint.dir"),
    ],
)
def test_invalid_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointConfig(**kwargs)


def test_cli_flags_reach_the_config():
    args = build_parser().parse_args(
        [
            "train",
            "--checkpoint-dir",
            "ck",
            "--checkpoint-every",
            "7",
            "--checkpoint-every-s",
            "30",
            "--keep-last",
            "2",
            "--no-async-checkpoint",
            "--resume",
            "never",
        ]
    )
    section = config_from_args(args).checkpoint
    assert (section.dir, section.every, section.every_s, section.keep_last) == ("ck", 7, 30.0, 2)
    assert section.async_save is False and section.resume == "never"
    args = build_parser().parse_args(["train", "--async-checkpoint"])
    assert config_from_args(args).checkpoint.async_save is True


def config_hash(config):
    return settings_hash(computation_settings(config, {"model": config.to_dict()["model"]}))


def test_config_hash_ignores_cosmetic_settings():
    a, b = preset("tiny"), preset("tiny")
    b.progress, b.log_every, b.checkpoint.dir = False, 3, "elsewhere"
    assert config_hash(a) == config_hash(b)
    b.optim.lr = 1.0
    assert config_hash(a) != config_hash(b)


def test_retention_rules():
    entries = [(s, m) for s, m in [(1, 5.0), (2, 1.0), (3, 4.0), (4, 3.0), (5, None)]]
    assert to_delete(entries, keep_last=2) == {1, 2, 3}
    assert to_delete(entries, keep_last=2, keep_best=1) == {1, 3}
    assert to_delete(entries, keep_last=0) == set()
    assert to_delete([(7, float("nan"))], keep_last=1, keep_best=1) == set()
    with pytest.raises(ValueError, match="keep_last and keep_best must be >= 0"):
        to_delete(entries, keep_last=-1)


def test_rng_round_trip_through_json():
    import json

    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    saved = json.loads(json.dumps(capture_rng()))
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    restore_rng(saved)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]
    with pytest.raises(CheckpointError, match="malformed RNG state"):
        restore_rng({"python": [1]})


def test_data_position_refuses_a_changed_global_batch():
    saved = data_position(step=10, seed=1, batch_size=32, num_train_tokens=1000)
    assert saved["samples_seen"] == 320 and saved["epoch"] == 0
    assert check_data_position(saved, seed=1, batch_size=32) == 10
    with pytest.raises(CheckpointError, match="global_batch=32 but this run has global_batch=16"):
        check_data_position(saved, seed=1, batch_size=16)
    with pytest.raises(CheckpointError, match="seed=1 but this run has seed=2"):
        check_data_position(saved, seed=2, batch_size=32)


def _rows(step: int, world: int, tokens: torch.Tensor) -> list[tuple[int, ...]]:
    rows = []
    for rank in range(world):
        x, _ = sample_batch(
            tokens, seed=7, step=step, batch_size=8, block_size=4, rank=rank, num_ranks=world
        )
        rows += [tuple(r.tolist()) for r in x]
    return rows


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (4, 1)])
def test_resharded_resume_continues_the_sample_stream(before, after):
    """Steps 0..N-1 at one world size + N..2N-1 at another = the straight run, sample for sample."""
    tokens = torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(0))
    n = 5
    straight = [_rows(s, 1, tokens) for s in range(2 * n)]
    resumed = [_rows(s, before, tokens) for s in range(n)] + [
        _rows(s, after, tokens) for s in range(n, 2 * n)
    ]
    assert resumed == straight  # same samples, same order within every global batch
    seen = [row for batch in resumed for row in batch]
    assert len(seen) == 2 * n * 8  # nothing lost: every step consumed one full global batch


def test_fault_specs():
    parsed = faults.parse(
        "kill:rank=1:step=7, slow:rank=0:ms=20,kill-in-save:rank=0:step=4:attempt=1"
    )
    assert parsed[0] == faults.Fault(kind="kill", rank=1, step=7)
    assert parsed[1].ms == 20.0 and parsed[2].attempt == 1
    with pytest.raises(ValueError, match="unknown kind 'explode'"):
        faults.parse("explode:rank=1")
    with pytest.raises(ValueError, match="needs rank= and"):
        faults.parse("kill:rank=1")


def test_slow_faults_hit_every_attempt_or_the_one_named_and_kills_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    killed: list[int] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    parsed = faults.parse("slow:rank=0:ms=200,slow:rank=0:ms=100:attempt=0,kill:rank=0:step=3")
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        faults.on_step_end(3, 1, parsed)  # another rank: nothing
        faults.on_step_end(3, 0, parsed)
    assert slept == [0.2, 0.1, 0.2]
    assert killed == [signal.SIGKILL]  # attempt 0 only
