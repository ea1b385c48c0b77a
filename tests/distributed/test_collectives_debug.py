"""Debug mode of the facade: a mismatched shape raises the documented error; a rank that skips a
collective yields the "never arrived" report (with all ranks' stacks in a file) instead of a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.comm import CollectiveHangError, CollectiveMismatchError, debug
from torsh_distributed.comm import collectives as C
from torsh_distributed.testing import run_distributed

DEBUG_TIMEOUT = 3.0


def _mismatch(from_env: bool) -> str:
    if not from_env:  # else TORSH_COMM_DEBUG=1 turns it on at the first collective
        debug.enable(timeout=30)
    C.all_reduce(torch.ones(4))  # seq 1 agrees
    shape = 4 if dist.get_rank() == 0 else 5
    try:
        C.all_reduce(torch.ones(shape))
    except CollectiveMismatchError as exc:
        return str(exc)
    finally:
        debug.disable()
    return "no error"


@pytest.mark.parametrize("from_env", [False, True])
def test_mismatched_shape_names_ranks_and_both_fingerprints(from_env):
    env = {"TORSH_COMM_DEBUG": "1"} if from_env else None
    for msg in run_distributed(_mismatch, 2, args=(from_env,), env=env, timeout=60):
        assert "collective mismatch" in msg
        assert "ranks [0] called all_reduce #2 on world (shape=[4], dtype=float32, op=SUM)" in msg
        assert "ranks [1] called all_reduce #2 on world (shape=[5], dtype=float32, op=SUM)" in msg


def _skip_collective(dump_dir: str) -> tuple[float, str, str]:
    debug.enable(timeout=DEBUG_TIMEOUT, dump_dir=dump_dir)
    C.broadcast(torch.ones(2), 0)
    done = Path(dump_dir) / "rank0-done"
    if dist.get_rank() == 1:
        # Skips the all_reduce below until rank 0 is past it; its stack shows this loop.
        deadline = time.monotonic() + DEBUG_TIMEOUT + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return (0.0, "", "")
    start = time.monotonic()
    try:
        C.all_reduce(torch.ones(3))
    except CollectiveHangError as exc:
        elapsed = time.monotonic() - start
        path = Path(str(exc).split("Python stacks of all ranks: ")[1].split(" Fix:")[0])
        return (elapsed, str(exc), path.read_text())
    finally:
        debug.disable()
        done.touch()
    return (0.0, "no error", "")


def test_rank_that_skips_a_collective_is_reported_within_timeout(tmp_path):
    started = time.monotonic()
    results = run_distributed(_skip_collective, 2, args=(str(tmp_path),), timeout=60)
    elapsed, msg, stacks = results[0]
    assert "rank 1 never arrived at all_reduce #2 on world" in msg, msg
    assert "its last collective was broadcast #1 on world" in msg
    assert DEBUG_TIMEOUT <= elapsed <= DEBUG_TIMEOUT + 5
    assert "===== rank 0 =====" in stacks and "===== rank 1 =====" in stacks
    assert "_skip_collective" in stacks.split("===== rank 1 =====")[1]  # rank 1's own stack
    assert time.monotonic() - started < 45
