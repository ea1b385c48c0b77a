"""What the Ray and Dask launcher tests share: rank functions, the training flags, the reference.

The rank functions live here (not in the test modules) so the workers can import them: Dask's
worker processes inherit ``sys.path``; the Ray test cluster gets this directory on
``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torsh_distributed.cli.train import add_config_arguments, config_from_args
from torsh_distributed.testing.cli import run_cli
from torsh_distributed.train.config import TrainConfig

HERE = Path(__file__).resolve().parent
TOLERANCE = 1e-5
# A few steps of the tiny preset on a small corpus: the same flags for `torsh-dist train` and
# for the config handed to the launchers' ranks.
FLAGS = [
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
    "8",
    "--progress",
    "false",
]
CHECKPOINTS = ["--checkpoint-every", "3", "--keep-last", "0", "--no-async-checkpoint"]
KILL_AT_STEP = 5  # rank 1 SIGKILLs itself after step 5; the last checkpoint is step 3


def train_config(*extra: str) -> TrainConfig:
    """The config `torsh-dist train FLAGS *extra` would run."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args([*FLAGS, *extra]))
    assert isinstance(config, TrainConfig)
    return config


@functools.lru_cache(maxsize=1)
def reference_summary() -> dict[str, Any]:
    """Summary JSON of ``torsh-dist train --nproc-per-node 2 FLAGS`` (run once per session)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        proc = run_cli(  # a warm process (torsh_distributed.testing.cli)
            ["train", "--nproc-per-node", "2", *FLAGS, "--summary-json", str(out)],
            timeout=240,
            cwd=tmp,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return json.loads(out.read_text())


def assert_same_run(result: Any, reference: dict[str, Any]) -> None:
    """A TrainResult of a launcher run equals the `torsh-dist train` reference."""
    assert result.world_size == reference["world_size"] == 2
    assert result.steps == reference["steps"]
    for key in ("initial_loss", "final_loss", "val_loss"):
        assert abs(getattr(result, key) - reference[key]) <= TOLERANCE, (
            key,
            getattr(result, key),
            reference[key],
        )


def all_reduce_rank(offset: float) -> dict[str, Any]:
    """Each rank contributes rank + offset; returns what it saw of the job."""
    tensor = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(tensor)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": tensor.item(),
        "pid": os.getpid(),
        "backend": dist.get_backend(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "GLOO_SOCKET_IFNAME",
                "TORSH_TEST_MARK",
            )
        },
    }


def profiler_running() -> bool:
    """Whether the Dask worker running this rank samples stacks (its ``profile`` callback)."""
    from distributed import get_worker

    dist.barrier()
    return bool(get_worker().periodic_callbacks["profile"].is_running())


def hang_on_rank_1(hang_s: float, mark: str) -> int:
    """Rank 1 never reaches the collective (a hung rank); rank 0 waits in it, having written
    the wall-clock time it started waiting to ``mark``, and the time its collective gave up to
    ``mark + ".raised"``."""
    if dist.get_rank() == 1:
        time.sleep(hang_s)
    else:
        Path(mark).write_text(repr(time.time()))
    tensor = torch.ones(1)
    try:
        dist.all_reduce(tensor)
    except Exception:
        Path(mark + ".raised").write_text(repr(time.time()))
        raise
    return int(tensor.item())


class HangTimeline:
    """When a launcher's driver built its error for a hung job (``failure_error``, patched in
    with :meth:`watch`), for :meth:`check`'s account of where the time went."""

    def __init__(self) -> None:
        self.failed_at: float | None = None
        self.rank0: Any = None  # rank 0's RankOutcome, as the driver received it

    def watch(self, monkeypatch: Any) -> None:
        from torsh_distributed.launch import _workers

        original = _workers.failure_error

        def recorded(outcomes: Any, **kwargs: Any) -> Any:
            self.failed_at = time.time()
            self.rank0 = outcomes.get(0)
            return original(outcomes, **kwargs)

        monkeypatch.setattr(_workers, "failure_error", recorded)

    def check(self, mark: Path, timeout_s: float, *, slack_s: float = 10.0) -> None:
        """The hung job ended because rank 0's collective timed out at ``timeout_s`` (not at the
        600 s the hung rank sleeps), and each step after that took at most ``slack_s``: rank 0
        giving up, the driver hearing of it (rank 0's clean-up, the launcher's transport,
        ``GRACE_S`` for the other rank), the launcher's own clean-up. Each bound has its own
        message, so a slow step is named."""
        from torsh_distributed.launch._workers import GRACE_S

        returned = time.time()
        waiting = float(mark.read_text())
        raised = float(Path(f"{mark}.raised").read_text())
        assert self.failed_at is not None, "the driver never built the job's error"
        finished = getattr(self.rank0, "finished_at", None)
        cleanup = getattr(self.rank0, "cleanup_s", None)
        steps = (
            f"waiting at {waiting:.2f}, rank 0 raised +{raised - waiting:.2f} s, its outcome "
            + ("(none)" if finished is None else f"+{finished - raised:.2f} s")
            + f", its clean-up {'not waited for' if cleanup is None else f'{cleanup:.2f} s'}, "
            f"the driver's error +{self.failed_at - raised:.2f} s, "
            f"returned +{returned - self.failed_at:.2f} s"
        )
        assert timeout_s - 0.1 <= raised - waiting <= timeout_s + slack_s, steps
        assert finished is not None and finished - raised <= slack_s, steps
        # Open defect: in 2 clean-clone runs of 6 under Ray, the driver heard of rank 0's error
        # 23 s after it was raised (6.2 s in 27 runs alone); where the time went, rank 0's
        # clean-up or Ray's return, is not found. Rank 0 now sends its outcome without waiting
        # more than 1 s for its clean-up (launch._teardown.CLEANUP_WAIT_S), and the steps above
        # are in the message. Bounded at 40 s more than the others so that the test still
        # fails if the launcher waits for the hung rank (600 s).
        assert self.failed_at - raised <= GRACE_S + 4 * slack_s, steps
        assert returned - self.failed_at <= slack_s, steps


def fail_on_rank_1(mark: str) -> int:
    """Rank 1 raises its own error; rank 0 writes its pid to ``mark`` and waits in a collective
    that will never complete (until the launcher stops it)."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses: bad shard 7")
    Path(mark).write_text(str(os.getpid()))
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return 0


def process_gone(pid: int, within_s: float = 10.0) -> bool:
    """True once ``pid`` has exited (a zombie awaiting its parent counts as exited)."""
    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def kill_time(log: Path) -> float:
    """Wall-clock time of the injected kill (from ``TORSH_FAULT_LOG``)."""
    events = [json.loads(line) for line in log.read_text().splitlines()]
    [kill] = [e for e in events if e["event"] == "kill"]
    return float(kill["t"])
