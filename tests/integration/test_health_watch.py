"""The health watch under ``torsh-dist train``: rank 0 names a hung rank and a straggler, with
its node and host, in the job's own output (real processes, Gloo, injected faults)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from torsh_distributed.testing.cli import kill_tree, start_cli

_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_ERROR_FILE")


def _run_until(fault: str, wanted: str, *extra: str, timeout: float = 120) -> str:
    """Start a 3-rank job with ``fault``; return its output once ``wanted`` appears, then kill it."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env.update(TORSH_FAULT=fault, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="torsh-health-") as tmp:
        log = Path(tmp) / "out.log"
        proc = start_cli(  # a warm process (torsh_distributed.testing.cli)
            ["train", "--nproc-per-node", "3", "--preset", "tiny", "--batch-size", "6",
             "--max-steps", "400", "--progress", "false", "--health-interval", "0.25",
             "--health-failed-after", "8", *extra],
            output=log, env=env,
        )  # fmt: skip
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        follow = proc.lines(log)
        try:
            for line in follow:  # the job runs 400 steps: far longer than the fault needs
                lines.append(line)
                if wanted in line or time.monotonic() > deadline:
                    break
        finally:
            follow.close()
            # torch starts every worker in its own session: kill the launcher's whole tree
            # (SIGKILL also ends the stopped rank, which would sit on a SIGTERM).
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:  # it ended first: the assertion on its output says why
                tree = []
            kill_tree(proc.pid)
            proc.wait(timeout=30)
            psutil.wait_procs(tree, timeout=30)
    return "".join(lines)


@pytest.mark.timeout(180)
def test_a_hung_rank_is_named_with_its_node_and_host() -> None:
    out = _run_until("stop:rank=2:step=5", "health: rank 2")
    line = next((x for x in out.splitlines() if "health: rank 2" in x), None)
    assert line is not None, out[-3000:]
    assert "(node 0, host " in line and ("FAILED" in line or "degraded" in line), line
    assert "health: rank 0" not in out and "health: rank 1" not in out  # only the hung one


@pytest.mark.timeout(180)
def test_a_straggler_is_named_with_monitor_on() -> None:
    out = _run_until("slow:rank=1:ms=250", "health: rank 1", "--monitor")
    line = next((x for x in out.splitlines() if "health: rank 1" in x), None)
    assert line is not None, out[-3000:]
    assert "degraded: straggler" in line and "(node 0, host " in line, line
