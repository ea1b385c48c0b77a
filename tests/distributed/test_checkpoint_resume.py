"""Exact resume and resharded resume of the built-in trainer (real Gloo ranks, DCP checkpoints).

* same world size: 2N steps straight == N steps, resume, N steps, bit for bit (parameters and
  losses), at 2 ranks and at 3 (where the order of a sum across ranks can change its last bits);
* world size 4 -> 2 and 2 -> 4: the resumed run continues the straight run's sample stream, so its
  losses match the straight run's (to float reduction-order noise, like the DP parity test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torsh_distributed.checkpoint import CheckpointManager, step_dir_name
from torsh_distributed.models.gpt import GPT
from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.configs import with_checkpoints
from torsh_distributed.train import TrainConfig, preset, train

N = 4  # checkpoint interval; runs are 2N steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _config(directory: Path, **checkpoint) -> dict:
    cfg = preset("tiny")
    cfg.max_steps = 2 * N
    cfg.batch_size = 8
    cfg.progress = False
    cfg.eval_batches = 1
    cfg.data.max_bytes = 200_000
    cfg.model.block_size = 32
    return with_checkpoints(cfg, directory, **{"every": N, **checkpoint}).to_dict()


def _train(config_dict: dict) -> dict:
    result = train(TrainConfig.from_dict(config_dict))
    return {
        "losses": result.losses,
        "steps": result.steps,
        "world": result.world_size,
        "exchanges": result.compression.get("steps"),  # DDP all-reduces this process counted
    }


def _weights(config_dict: dict, path: Path) -> dict[str, torch.Tensor]:
    model = GPT(TrainConfig.from_dict(config_dict).model)
    loaded = CheckpointManager(path.parent).load(model=model, path=path)
    assert loaded is not None  # can fail: load returns None when no valid checkpoint is found
    return model.state_dict()


@pytest.fixture(scope="module")
def straight_two_ranks(tmp_path_factory) -> tuple[dict, dict]:
    """2N steps at world size 2 with checkpoints at N and 2N."""
    cfg = _config(tmp_path_factory.mktemp("straight2"))
    result = run_distributed(_train, 2, args=(cfg,), timeout=240)
    assert result[0]["steps"] == 2 * N
    return cfg, result[0]


def test_resume_at_same_world_size_is_bitwise_exact(straight_two_ranks, tmp_path):
    cfg, straight = straight_two_ranks
    first_half = Path(cfg["checkpoint"]["dir"]) / step_dir_name(N)
    resumed_cfg = _config(tmp_path, resume=str(first_half))
    resumed = run_distributed(_train, 2, args=(resumed_cfg,), timeout=240)[0]
    assert resumed["losses"] == straight["losses"], "loss history differs after resume"
    a = _weights(cfg, Path(cfg["checkpoint"]["dir"]) / step_dir_name(2 * N))
    b = _weights(resumed_cfg, tmp_path / step_dir_name(2 * N))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    assert not (tmp_path / step_dir_name(N)).exists(), "the resumed run redid step N's save"


def test_resume_at_three_ranks_is_bitwise_exact(tmp_path):
    """At 3 ranks Gloo's ring all-reduce sums each gradient element in an order set by its place
    in DDP's bucket, and DDP re-buckets after a process's first backward: a resumed run whose
    first step used the initial layout differed in the last bits (step N + 3's loss, measured).
    The engine re-buckets before that step (prime_ddp); the run then continues bit for bit."""
    straight_cfg = _config(tmp_path / "straight")
    resumed_cfg = _config(
        tmp_path / "resumed", resume=str(tmp_path / "straight" / step_dir_name(N))
    )
    for cfg in (straight_cfg, resumed_cfg):
        cfg["batch_size"] = 12
    straight = run_distributed(_train, 3, args=(straight_cfg,), timeout=300)[0]
    resumed = run_distributed(_train, 3, args=(resumed_cfg,), timeout=300)[0]
    assert resumed["world"] == 3 and resumed["losses"] == straight["losses"]
    assert resumed["exchanges"] == N  # the priming's forward is not counted as a step
    a = _weights(straight_cfg, tmp_path / "straight" / step_dir_name(2 * N))
    b = _weights(resumed_cfg, tmp_path / "resumed" / step_dir_name(2 * N))
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"


def _check_continues(straight: dict, resumed: dict, world: int) -> None:
    assert resumed["world"] == world and len(resumed["losses"]) == 2 * N
    assert resumed["losses"][:N] == straight["losses"][:N]  # history carried over verbatim
    for step in range(N, 2 * N):
        a, b = straight["losses"][step], resumed["losses"][step]
        assert b == pytest.approx(a, rel=1e-5), f"step {step + 1}: {a} vs {b}"


@pytest.mark.slow
def test_reshard_two_to_four_ranks_continues_the_data_stream(straight_two_ranks, tmp_path):
    cfg, straight = straight_two_ranks
    saved_at_two = Path(cfg["checkpoint"]["dir"]) / step_dir_name(N)
    resumed = run_distributed(
        _train, 4, args=(_config(tmp_path, resume=str(saved_at_two)),), timeout=300
    )[0]
    _check_continues(straight, resumed, world=4)


@pytest.mark.slow
def test_reshard_four_to_two_ranks_continues_the_data_stream(tmp_path):
    cfg4 = _config(tmp_path / "four")
    straight = run_distributed(_train, 4, args=(cfg4,), timeout=300)[0]
    saved_at_four = tmp_path / "four" / step_dir_name(N)
    resumed = run_distributed(
        _train, 2, args=(_config(tmp_path / "two", resume=str(saved_at_four)),), timeout=240
    )[0]
    _check_continues(straight, resumed, world=2)
    a = _weights(cfg4, tmp_path / "four" / step_dir_name(2 * N))
    b = _weights(cfg4, tmp_path / "two" / step_dir_name(2 * N))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def _changed_batch(config_dict: dict) -> str:
    try:
        train(TrainConfig.from_dict(config_dict))
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_resume_with_a_different_global_batch_is_refused(straight_two_ranks, tmp_path):
    cfg, _ = straight_two_ranks
    changed = _config(tmp_path, resume=str(Path(cfg["checkpoint"]["dir"]) / step_dir_name(N)))
    changed["batch_size"] = 4
    messages = run_distributed(_changed_batch, 2, args=(changed,), timeout=120)
    for message in messages:
        assert (
            "CheckpointError" in message
            and "global_batch=8 but this run has global_batch=4" in message
        )


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "before", "after"), [(1, 2, 4), (3, 4, 2)])
def test_reshard_zero_sharded_checkpoints(tmp_path, stage, before, after):
    """ZeRO-1 (sharded optimizer state) and ZeRO-3 (FSDP2 DTensor shards) reshard on resume."""
    cfg = _config(tmp_path / "straight")
    cfg["parallel"]["zero_stage"] = stage
    straight = run_distributed(_train, before, args=(cfg,), timeout=300)[0]
    resumed_cfg = _config(
        tmp_path / "resumed", resume=str(tmp_path / "straight" / step_dir_name(N))
    )
    resumed_cfg["parallel"]["zero_stage"] = stage
    resumed = run_distributed(_train, after, args=(resumed_cfg,), timeout=300)[0]
    _check_continues(straight, resumed, world=after)
    a = _weights(cfg, tmp_path / "straight" / step_dir_name(2 * N))
    b = _weights(cfg, tmp_path / "resumed" / step_dir_name(2 * N))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def _train_precision(config_dict: dict) -> dict:
    result = train(TrainConfig.from_dict(config_dict))
    return {"steps": result.steps, "precision": result.precision}


def test_fp16_loss_scale_is_restored_on_resume(tmp_path):
    """The dynamic loss scale is part of the checkpoint: a resumed run does not re-learn it."""
    cfg = _config(tmp_path, every=2)
    cfg["max_steps"] = 4
    cfg["parallel"].update(
        zero_stage=3, param_dtype="fp16", loss_scale_init=2.0**17, loss_scale_growth_interval=1000
    )
    first = run_distributed(_train_precision, 2, args=(cfg,), timeout=240)[0]
    # 2**17 and 2**16 overflow fp16: the first two steps are skipped and the scale settles at 2**15.
    assert first["precision"]["skipped_steps"] == 2
    assert first["precision"]["loss_scale"] == 2.0**15
    cfg["max_steps"] = 6
    resumed = run_distributed(_train_precision, 2, args=(cfg,), timeout=240)[0]
    assert resumed["steps"] == 6
    # Restored at 2**15: no step of the resumed run overflows (a fresh 2**17 would skip two again).
    assert resumed["precision"]["skipped_steps"] == 0, resumed["precision"]
    assert resumed["precision"]["loss_scale"] == 2.0**15


def _train_twice(first: dict, second: dict) -> list[dict]:
    out = []
    for config_dict in (first, second):
        result = train(TrainConfig.from_dict(config_dict))
        out.append({"losses": result.losses, "compression": result.compression})
    return out


def test_compression_state_is_checkpointed_per_rank_and_resumes_exactly(tmp_path):
    """TopK + error feedback: residuals are per rank; a resumed run continues bit for bit."""
    straight_cfg = _config(tmp_path / "straight")
    resumed_cfg = _config(
        tmp_path / "resumed", resume=str(tmp_path / "straight" / step_dir_name(N))
    )
    for cfg in (straight_cfg, resumed_cfg):
        cfg["compression"]["method"] = "topk:0.05"
    straight, resumed = run_distributed(
        _train_twice, 2, args=(straight_cfg, resumed_cfg), timeout=240
    )[0]
    assert resumed["losses"] == straight["losses"], "losses differ after resuming compression"
    # The accounting is part of the state: the resumed run's totals cover all 2N steps.
    for key in ("steps", "bytes_sent", "bytes_uncompressed"):
        assert resumed["compression"][key] == straight["compression"][key], key
    saved = tmp_path / "straight" / step_dir_name(N)
    residuals = [
        torch.load(saved / f"rank_{r:05d}.pt", weights_only=True)["compression"]["compressor"]
        for r in (0, 1)
    ]
    r0, r1 = (next(iter(r["residuals"].values())) for r in residuals)
    assert r0.abs().sum() > 0 and not torch.equal(r0, r1), "residuals must be per rank"
    # The per-rank file is covered by the manifest: a flipped byte invalidates the checkpoint.
    from torsh_distributed.checkpoint import manifest

    blob = bytearray((saved / "rank_00001.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (saved / "rank_00001.pt").write_bytes(bytes(blob))
    verdict = manifest.verify(saved)
    assert not verdict.valid and verdict.file == "rank_00001.pt", verdict
