"""Fault injection end to end: real `torsh-dist train` jobs, real SIGKILLs, elastic restarts.

Faults come from ``TORSH_FAULT`` (see ``torsh_distributed.checkpoint.faults``): the chosen rank
sends itself SIGKILL at the chosen step (first attempt only); ``--max-restarts 1`` lets torch's
elastic agent restart the job, which resumes from the newest valid checkpoint by itself. The
random rank and step come from a seed printed in every assertion message (``TORSH_FAULT_SEED``
replays a failure).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.checkpoint import CheckpointManager, faults, scan, step_dir_name
from torsh_distributed.elastic.health import (
    DEGRADED,
    HealthMonitor,
    Heartbeat,
    gather_step_times,
    straggler_report,
)
from torsh_distributed.models.gpt import GPT
from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.cli import run_cli
from torsh_distributed.train import TrainConfig

EVERY, STEPS = 3, 10
TINY = [
    "--preset",
    "tiny",
    "--data.max-bytes",
    "200000",
    "--eval-batches",
    "1",
    "--block-size",
    "32",
    "--batch-size",
    "8",
    "--max-steps",
    str(STEPS),
    "--progress",
    "false",
    "--checkpoint-every",
    str(EVERY),
    "--keep-last",
    "0",
]
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_ERROR_FILE",
    "TORSH_FAULT",
    "TORSH_FAULT_LOG",
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _train(
    directory: Path, *extra: str, fault: str = "", log: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    if fault:
        env["TORSH_FAULT"] = fault
    if log is not None:
        env["TORSH_FAULT_LOG"] = str(log)
    argv = [
        "train",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        *TINY,
        "--checkpoint-dir",
        str(directory),
        *extra,
    ]
    return run_cli(argv, env=env, timeout=300)  # a warm process (torsh_distributed.testing.cli)


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _final_weights(directory: Path) -> dict[str, torch.Tensor]:
    config = TrainConfig.from_dict({"model": {"block_size": 32}})
    model = GPT(config.model)
    CheckpointManager(directory).load(model=model, path=directory / step_dir_name(STEPS))
    return model.state_dict()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same job without faults: its final checkpoint is the ground truth."""
    directory = tmp_path_factory.mktemp("reference")
    proc = _train(directory, "--no-async-checkpoint")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return directory


@pytest.mark.slow
def test_sigkill_of_a_random_rank_restarts_and_resumes_exactly(reference, tmp_path):
    seed = int(os.environ.get("TORSH_FAULT_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    rank, step = rng.randrange(2), rng.randrange(1, STEPS)
    ctx = f"(seed {seed}: SIGKILL rank {rank} after step {step})"
    log = tmp_path / "faults.jsonl"
    proc = _train(
        tmp_path / "ckpt", "--no-async-checkpoint", fault=f"kill:rank={rank}:step={step}", log=log
    )
    assert proc.returncode == 0, ctx + proc.stdout[-3000:] + proc.stderr[-3000:]
    events = _events(log)
    kills = [e for e in events if e["event"] == "kill"]
    assert [(k["rank"], k["step"], k["attempt"]) for k in kills] == [(rank, step, 0)], ctx
    resumed = [e["step"] for e in events if e["event"] == "resumed"]
    resumed_step = resumed[0] if resumed else 0
    assert step - resumed_step <= EVERY, f"{ctx}: redid {step - resumed_step} steps"
    assert resumed_step == step - step % EVERY, ctx
    if resumed:
        assert (
            f"checkpoint: resumed from {tmp_path / 'ckpt' / step_dir_name(resumed_step)}"
            in proc.stdout
        )
    expected, got = _final_weights(reference), _final_weights(tmp_path / "ckpt")
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{ctx}: {name} differs from the clean run"


@pytest.mark.slow
def test_kill_during_async_save_never_loads_the_partial_checkpoint(tmp_path):
    log = tmp_path / "faults.jsonl"
    kill_step = 2 * EVERY
    proc = _train(
        tmp_path / "ckpt",
        "--async-checkpoint",
        fault=f"kill-in-save:rank=0:step={kill_step}",
        log=log,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = _events(log)
    assert [(e["step"], e["where"]) for e in events if e["event"] == "kill"] == [
        (kill_step, "save")
    ]
    resumed = [e["step"] for e in events if e["event"] == "resumed"]
    assert resumed == [EVERY], f"resumed from {resumed}: the half-written step {kill_step} was used"
    infos = scan(tmp_path / "ckpt")
    assert all(info.valid for info in infos) and infos[0].step == STEPS
    assert not list((tmp_path / "ckpt").glob(".tmp-*")), "partial checkpoint left behind"


def test_corrupt_file_fails_verify_and_resume_uses_the_previous_checkpoint(reference, tmp_path):
    import shutil

    directory = tmp_path / "copy"
    shutil.copytree(reference, directory)
    newest = directory / step_dir_name(STEPS)
    shard = sorted(newest.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40
    shard.write_bytes(bytes(data))
    proc = run_cli(["checkpoint", "verify", str(directory)], timeout=60)
    assert proc.returncode == 1
    assert f"INVALID ({shard.name}): SHA-256 mismatch" in proc.stdout
    assert f"a resume would load {directory / step_dir_name(9)}" in proc.stdout
    model = GPT(TrainConfig.from_dict({"model": {"block_size": 32}}).model)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {newest}: INVALID .{shard.name}"):
        loaded = CheckpointManager(directory).load(model=model)
    assert loaded is not None and loaded.step == 9 and loaded.path == directory / step_dir_name(9)


def _slow_rank_job(slow_rank: int, steps: int) -> dict:
    os.environ["TORSH_FAULT"] = f"slow:rank={slow_rank}:ms=60"
    rank, store = dist.get_rank(), dist.distributed_c10d._get_default_store()
    beat = Heartbeat(store, rank, interval_s=0.2, prefix="test/hb")
    beat.beat()
    active = faults.active()
    times = []
    x = torch.randn(16, 16)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        x = torch.tanh(x @ x.T / 16)  # a token of compute: the injected sleep must dominate
        faults.on_step_end(step, rank, active)
        times.append(time.perf_counter() - t0)  # compute time, before the synchronising collective
        beat.update(step, times[-1])
        beat.beat()
        dist.barrier()
    report = straggler_report(gather_step_times(times), k=1)
    health = HealthMonitor(store, dist.get_world_size(), interval_s=0.2, prefix="test/hb").poll()
    return {
        "slowest": report.slowest[0].rank,
        "cost": report.slowest[0].cost_s,
        "table": report.format(),
        "health": [(h.rank, h.state, h.reason) for h in health],
    }


def test_a_deliberately_slow_rank_is_named_by_the_straggler_report():
    result = run_distributed(_slow_rank_job, 3, args=(1, 8), timeout=120)[0]
    assert result["slowest"] == 1, result["table"]
    assert result["cost"] >= 8 * 0.040, result["table"]  # ~60 ms per step over the median
    assert "slowest over 8 steps: rank 1" in result["table"]
    states = {rank: (state, reason) for rank, state, reason in result["health"]}
    assert states[1][0] == DEGRADED and states[1][1].startswith("straggler"), states
    assert states[0][0] == "healthy" and states[2][0] == "healthy", states


# --- what the launcher and the trainer say about restarts (default verbosity) --------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restarts_are_said_and_the_summary_totals_every_attempt(tmp_path):
    # attempt 0: rank 1 dies after step 2, before the first checkpoint (step 3);
    # attempt 1: resumes at step 0, saves step 3, rank 0 dies after step 5;
    # attempt 2: resumes at step 3 and finishes.
    fault = "kill:rank=1:step=2,kill:rank=0:step=5:attempt=1"
    summary = tmp_path / "summary.json"
    directory = tmp_path / "ckpt"
    proc = _train(
        directory, "--no-async-checkpoint", "--max-restarts", "2", "--summary-json", str(summary),
        fault=fault,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # the launcher: one line per failure, one per restart
    assert "torsh-dist: rank 1 failed (local rank 1, node 0, host " in proc.stderr, out
    assert "; killed by SIGKILL)\ntorsh-dist: restart 1 of 2 (--max-restarts 2)" in proc.stderr, out
    assert "torsh-dist: rank 0 failed (local rank 0, node 0, host " in proc.stderr, out
    assert "; killed by SIGKILL)\ntorsh-dist: restart 2 of 2 (--max-restarts 2)" in proc.stderr, out
    assert proc.stderr.count("failed (local rank") == 2, out  # ranks stopped by the agent: not failures
    # the trainer: where each attempt resumed, also at step 0
    assert (
        "[rank0]: checkpoint: resumed at step 0 (no checkpoint yet; 2 step(s) lost): the previous "
        "attempt reached step 2 at world size 2" in proc.stdout
    ), out
    assert f"[rank0]: checkpoint: resumed from {directory / step_dir_name(3)} at step 3" in proc.stdout
    assert (
        "[rank0]: checkpoint: the previous attempt reached step 5 at world size 2: 2 step(s) lost"
        in proc.stdout
    ), out
    assert "2 restart(s), 4 step(s) lost and recomputed over all attempts" in proc.stdout, out
    assert re.search(r"\| checkpoint restarts +\| +2 \|", proc.stdout), out
    assert re.search(r"\| checkpoint lost steps +\| +4 \|", proc.stdout), out
    block = json.loads(summary.read_text())["checkpoint"]
    assert (block["restarts"], block["lost_steps"], block["resumed_step"]) == (2, 4, 3), block
    attempts = [(a["attempt"], a["resumed_step"], a["reached_step"]) for a in block["attempts"]]
    assert attempts == [(0, 0, 2), (1, 0, 5), (2, 3, STEPS)], block
    assert block["saves"] == 4, block  # step 3 in attempt 1; 6, 9 and the final 10 in attempt 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_larger_max_steps_continues_the_schedule_and_other_changes_are_named(reference, tmp_path):
    import shutil

    longer = tmp_path / "longer"
    shutil.copytree(reference, longer)
    proc = _train(longer, "--max-steps", str(STEPS + 2), "--no-async-checkpoint")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (
        f"[rank0]: checkpoint: max_steps {STEPS} -> {STEPS + 2}: continuing the schedule (" in out
    ), out
    assert "different configuration" not in out, out
    assert "previous attempt" not in out, out  # a rerun of a finished run lost nothing

    changed = tmp_path / "changed"
    shutil.copytree(reference, changed)
    proc = _train(changed, "--max-steps", str(STEPS + 2), "--lr", "0.01", "--no-async-checkpoint")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (
        f"was written by a run with a different configuration: max_steps {STEPS} -> {STEPS + 2}, "
        "optim.lr 0.003 -> 0.01" in out
    ), out
