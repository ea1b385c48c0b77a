"""The engine's default intra-op threads: the cores this process may use (its affinity mask, as
under `taskset` or a cpuset), divided by the local ranks, not every core of the machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import os, sys, torch
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
from torsh_distributed.train import TrainConfig, preset, train
cfg = preset("tiny")
cfg.max_steps, cfg.batch_size, cfg.eval_batches, cfg.progress = 1, 2, 1, False
cfg.data.max_bytes = 20000
torch.set_num_threads(4)
train(TrainConfig.from_dict(cfg.to_dict()))
print("threads", torch.get_num_threads())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs an affinity mask of 2 or more cores to restrict")  # fmt: skip
def test_one_usable_core_means_one_thread_whatever_the_machine_has() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "threads 1", proc.stdout[-2000:]
