"""``horovod.run`` (``torsh_distributed.horovod.run``) on real processes: a function that calls
``hvd.allreduce`` on 2 ranks returns each rank's value (tensors included, through pickled bytes);
a rank that raises is reported with its traceback; a rank that dies is named with its exit code;
a collective whose peer never arrives times out instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import torsh_distributed.horovod as horovod
import torsh_distributed.horovod.torch as hvd
from torsh_distributed.runtime.errors import DistributedTimeoutError, ProcessFailureError

START = 120.0  # seconds for the ranks' imports on a loaded 2-core machine


def _allreduce(scale: float, *, rows: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    hvd.init()
    mine = torch.full((rows, 3), float(hvd.rank() + 1)) * scale
    summed = hvd.allreduce(mine, op=hvd.Sum, name="x")
    big = torch.arange(200_000, dtype=torch.float64) + hvd.rank()  # 1.6 MB back through a file
    return hvd.rank(), hvd.size(), summed, big


def test_run_returns_every_ranks_value_in_rank_order():
    results = horovod.run(_allreduce, args=(2.0,), kwargs={"rows": 4}, num_proc=2, start_timeout=START)
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    for rank, (_, _, summed, big) in enumerate(results):
        assert torch.equal(summed, torch.full((4, 3), 6.0))  # 2 * (1 + 2)
        assert torch.equal(big, torch.arange(200_000, dtype=torch.float64) + rank)


def _rank_one_raises() -> int:
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank 1 refuses to reduce")
    return int(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())


def _rank_one_dies() -> int:
    hvd.init()
    if hvd.rank() == 1:
        os._exit(7)
    return int(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())


def test_a_failing_rank_is_raised_with_its_traceback(tmp_path: Path):
    with pytest.raises(ProcessFailureError, match=r"rank 1 of 2 failed .*ValueError: rank 1 refuses to reduce") as info:
        horovod.run(_rank_one_raises, num_proc=2, start_timeout=START, output_filename=str(tmp_path))
    text = str(info.value)
    assert "_rank_one_raises" in text and 'raise ValueError("rank 1 refuses to reduce")' in text  # the traceback
    assert isinstance(info.value.__cause__, ValueError)
    # Horovod's output layout: DIR/rank.<rank>/stdout|stderr
    assert {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()} == {
        "rank.0/stdout", "rank.0/stderr", "rank.1/stdout", "rank.1/stderr"}
    with pytest.raises(ProcessFailureError, match=r"rank 1 of 2 died .*exited with code 7 before reporting"):
        horovod.run(_rank_one_dies, num_proc=2, start_timeout=START)


def _rank_one_never_arrives() -> float:
    hvd.init()
    if hvd.rank() == 1:
        threading.Event().wait()  # blocks forever: its peer's all-reduce must time out
    return float(hvd.allreduce(torch.ones(1)).item())


def test_a_collective_whose_peer_never_arrives_times_out():
    # rank 0's all-reduce gives up after timeout_s (Horovod's API raises HorovodInternalError,
    # whose message holds the backend's timeout: `auto` picks gloo+shm for two local ranks,
    # which names the rank; Gloo's says "Timed out waiting 5000ms"); the hung rank 1 is stopped,
    # nothing waits for it.
    began = time.monotonic()
    timed_out = r"(rank 1 did not reach all_reduce\(sum\) over shared memory: it did not arrive within 5 s|Timed out waiting 5000ms)"
    with pytest.raises(ProcessFailureError, match=rf"rank 0 of 2 failed .*HorovodInternalError.*{timed_out}") as info:
        horovod.run(_rank_one_never_arrives, num_proc=2, start_timeout=START, timeout_s=5)
    assert "rank(s) 1 had not finished and were stopped" in str(info.value)
    assert time.monotonic() - began < START + 30


def test_ranks_that_do_not_start_in_time_are_named():
    # 10 ms: shorter than any interpreter's start, so no rank can be ready in time
    with pytest.raises(DistributedTimeoutError, match=r"rank\(s\) 0, 1 did not start within start_timeout 0.01 s"):
        horovod.run(_rank_one_raises, num_proc=2, start_timeout=0.01)


SCRIPT = '''
import torch
import torsh_distributed.horovod as horovod
import torsh_distributed.horovod.torch as hvd


def train(base):
    hvd.init()
    return hvd.allreduce(torch.tensor([base + hvd.rank()]), op=hvd.Sum).item()


print("RESULTS", horovod.run(train, args=(10.0,), num_proc=2, start_timeout=START))
'''


def test_a_script_without_a_main_guard_runs_a_function_of_its_own(tmp_path: Path):
    # Horovod's examples define the function in the script itself and call horovod.run at top
    # level: the function travels by value (cloudpickle) and the ranks never import the script.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("START", str(START)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=START + 60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULTS [21.0, 21.0]" in proc.stdout  # (10 + 0) + (10 + 1) on both ranks
