"""Checkpoints and monitoring of the model-parallel loop (tensor and pipeline parallelism).

* tp2 and pp2 (1F1B): 2N steps straight == N steps, resume, N steps, bit for bit;
* the pipeline ranks write one whole model under the unsplit GPT's names, so a pp2 checkpoint
  resumes in a plain data-parallel run (losses to reduction-order noise);
* a tp2 checkpoint (qkv rows in TP order) is refused by a run without TP, with an error that
  names both layouts, instead of loading scrambled weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh_distributed.checkpoint import step_dir_name
from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.configs import small_config, with_checkpoints
from torsh_distributed.train import TrainConfig, train

N = 3  # checkpoint interval; runs are 2N steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _config(directory: Path, parallel: dict, **checkpoint) -> TrainConfig:
    cfg = with_checkpoints(small_config(2 * N), directory, every=N, **checkpoint)
    data = cfg.to_dict()
    data["parallel"] = parallel
    return TrainConfig.from_dict(data)


def _cases(root: str) -> dict:
    from torsh_distributed.runtime.errors import CheckpointError

    base, out = Path(root), {}
    layouts = {
        "tp2": {"tp": 2},
        "pp2": {"pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
    }
    for name, parallel in layouts.items():
        straight = train(_config(base / name, parallel))
        half = base / name / step_dir_name(N)
        resumed = train(_config(base / f"{name}-resumed", parallel, resume=str(half)))
        out[name] = (straight.losses, resumed.losses, resumed.checkpoint.get("resumed_step"))
    # the pp2 checkpoint, resumed without pipeline (one model, the GPT's own names)
    dp = train(_config(base / "pp2-as-dp", {}, resume=str(base / "pp2" / step_dir_name(N))))
    out["pp2->dp"] = dp.losses
    try:
        train(_config(base / "tp2-as-dp", {}, resume=str(base / "tp2" / step_dir_name(N))))
        out["tp2->dp"] = "loaded"
    except CheckpointError as exc:
        out["tp2->dp"] = str(exc)
    return out


def test_model_parallel_checkpoints_resume(tmp_path):
    r = run_distributed(_cases, 2, args=(str(tmp_path),), timeout=300)[0]
    for name in ("tp2", "pp2"):
        straight, resumed, step = r[name]
        assert step == N, name
        assert len(straight) == len(resumed) == 2 * N
        assert resumed == straight, f"{name}: losses differ after resume"
    straight_pp = r["pp2"][0]
    dp = r["pp2->dp"]
    assert dp[:N] == straight_pp[:N]  # history carried over
    for step in range(N, 2 * N):
        assert dp[step] == pytest.approx(straight_pp[step], rel=1e-4), (step, dp, straight_pp)
    message = r["tp2->dp"]
    assert "{'tp': 2}" in message and "plain" in message and "--tp" in message, message


def _monitored(root: str) -> dict:
    parallel = {"pp": 2, "pp_schedule": "1f1b", "microbatches": 2}
    plain = train(_config(Path(root) / "plain", parallel, save_final=False))
    cfg = _config(Path(root) / "mon", parallel, save_final=False)
    cfg.monitor.enabled, cfg.monitor.every = True, 2
    cfg.monitor.report_json = str(Path(root) / "report.json")
    watched = train(cfg)
    return {"plain": plain.losses, "watched": watched.losses, "report": watched.monitor}


def test_model_parallel_loop_is_monitored(tmp_path):
    """--monitor under a pipeline: a report over both ranks, throughput counted once per data-
    parallel replica, and the same losses as without monitoring."""
    r = run_distributed(_monitored, 2, args=(str(tmp_path),), timeout=240)[0]
    assert r["watched"] == r["plain"]
    report = r["report"]
    assert report["world_size"] == 2 and len(report["per_rank"]) == 2
    assert report["breakdown"]["backward"] > 0 and report["tokens_per_s"] > 0
    written = (tmp_path / "report.json").read_text()
    assert '"per_rank"' in written
