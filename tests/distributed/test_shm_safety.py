"""``gloo+shm`` failure paths on real processes: a rank SIGKILLed in the middle of all-reduces and a
rank that hangs both give the peer our timeout error (naming the rank and the operation) within
timeout + 5 s, and no segment of the job is left in /dev/shm, whether the call waits or the
error comes from the progress thread through ``Work.wait()`` (the same message); stale segments of dead jobs are
found and removed, live ones kept."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.runtime import _shm_segment as segment_module
from torsh_distributed.runtime import world
from torsh_distributed.runtime.errors import DistributedTimeoutError
from torsh_distributed.runtime.shm import cleanup_stale_segments
from torsh_distributed.testing import RankFailedError, run_distributed

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")

TIMEOUT_S = 3.0


def _victim(mode: str, out: str, async_op: bool) -> int:
    world.init(backend="gloo+shm", timeout=TIMEOUT_S)
    rank = dist.get_rank()
    buf = torch.ones(3_000_000)  # 12 MB: three 4 MB chunks per all-reduce
    dist.all_reduce(buf)
    if rank == 1:
        if mode == "kill":  # die 50 ms into the loop below: inside an all-reduce
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:  # hang: miss the next all-reduce until rank 0 has given up, then leave
            deadline = time.monotonic() + 60
            while not Path(out).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return os.getpid()
    start = time.monotonic()
    result: dict = {"pid": os.getpid(), "error": None}
    try:
        for _ in range(100000):
            if async_op:  # two in flight on the progress thread: the first wait raises
                works = [dist.all_reduce(buf, async_op=True) for _ in range(2)]
                for work in works:
                    work.wait()
            else:
                dist.all_reduce(buf)
    except DistributedTimeoutError as exc:
        result.update(error=str(exc), elapsed=time.monotonic() - start)
    Path(out).write_text(json.dumps(result))
    return os.getpid()


@pytest.mark.parametrize("async_op", [False, True], ids=["waiting", "async"])
@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_dead_or_hung_peer_raises_timeout_error_and_leaves_no_segment(tmp_path, mode, async_op):
    out = tmp_path / "rank0.json"
    args = (mode, str(out), async_op)
    if mode == "kill":
        with pytest.raises(RankFailedError, match="rank 1 of 2 failed"):
            run_distributed(_victim, 2, args=args, init=False, timeout=60)
    else:
        run_distributed(_victim, 2, args=args, init=False, timeout=60)
    result = json.loads(out.read_text())
    assert result["error"] is not None, "rank 0 finished every all-reduce"
    assert "rank 1 did not reach all_reduce(sum)" in result["error"]
    assert result["elapsed"] < TIMEOUT_S + 5
    if mode == "kill":
        assert "has exited" in result["error"]
    else:
        assert f"did not arrive within {TIMEOUT_S:g} s" in result["error"]
        assert result["elapsed"] >= TIMEOUT_S - 0.5
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"torsh-shm-{result['pid']}-")] == []


def _fake_segment(directory: Path, creator: int, pids: list[int], token: str) -> Path:
    path = directory / f"torsh-shm-{creator}-{token * 16}"
    head = b"TORSHSHM" + struct.pack("<II", 1, len(pids)) + bytes(48)
    path.write_bytes(head + struct.pack(f"<{len(pids)}q", *pids))
    return path


def test_stale_segments_of_dead_jobs_are_removed_live_ones_kept(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid is dead
    stale = _fake_segment(tmp_path, gone.pid, [gone.pid, gone.pid], "ab")
    live = _fake_segment(tmp_path, gone.pid, [gone.pid, os.getpid()], "cd")  # a rank is alive
    other = tmp_path / "torch_123_456"
    other.write_bytes(b"x")
    assert cleanup_stale_segments(tmp_path) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()


# The module needs only the standard library: loaded by path, the child starts in milliseconds.
_CREATE = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("_shm_segment", sys.argv[2])
mod = importlib.util.module_from_spec(spec)
sys.modules["_shm_segment"] = mod
spec.loader.exec_module(mod)
Segment, new_name = mod.Segment, mod.new_name
seg = Segment.create(new_name(), size=8192, num_ranks=2)
print(seg.name, flush=True)
if sys.argv[1] == "term":
    os.kill(os.getpid(), signal.SIGTERM)  # dies by the signal after unlinking
"""


@pytest.mark.parametrize("how", ["term", "exit"])
def test_a_segment_not_yet_attached_is_unlinked_on_sigterm_and_exit(how):
    done = subprocess.run(
        [sys.executable, "-c", _CREATE, how, segment_module.__file__],
        capture_output=True,
        text=True,
        timeout=60,
    )
    name = done.stdout.strip()
    assert name.startswith("torsh-shm-") and len(name.rsplit("-", 1)[1]) == 32, done.stderr
    assert done.returncode == (-signal.SIGTERM if how == "term" else 0), done.stderr
    assert not (Path("/dev/shm") / name).exists()
