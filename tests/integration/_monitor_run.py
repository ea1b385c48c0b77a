"""A 2-rank `torsh-dist train` run in the background for the monitoring integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from torsh_distributed.monitor.step import SLOW_RANK_ENV
from torsh_distributed.testing.cli import start_cli

TRAIN = ["train", "--nproc-per-node", "2",  # torsh-dist's arguments (start_cli)
         "--preset", "tiny", "--data.max-bytes", "300000", "--eval-batches", "1",
         "--batch-size", "16", "--log-every", "5"]


class TrainingRun:
    """``torsh-dist train`` in its own process group (launcher and ranks are stopped together)."""

    def __init__(self, args: list[str], log: Path, *, slow_rank: str = "") -> None:
        env = dict(os.environ)
        if slow_rank:
            env[SLOW_RANK_ENV] = slow_rank
        self.log = log
        # a warm process (torsh_distributed.testing.cli), leading its own process group
        self.proc = start_cli([*TRAIN, *args], output=log, env=env)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_http(self, url: str, *, timeout: float = 180.0) -> None:
        """Until ``url`` answers 200; AssertionError with the run's output if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"training exited ({self.proc.returncode}) early:\n{self.output()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{url} did not answer within {timeout} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
