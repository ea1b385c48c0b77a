"""Suite-wide settings: no test may leave a process group or stray env behind."""

from __future__ import annotations

import os

import pytest

# Worker processes of the harness import the package from the preloaded forkserver;
# quiet torch's C++ warnings about gloo interfaces on machines without a hostname entry.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# Most ranks train through the engine: the harness's forkserver imports it once per session
# instead of every rank of every test importing it again (~2 s per run on 2 cores).
os.environ.setdefault(
    "TORSH_TEST_PRELOAD", "torsh_distributed.engine.engine,torsh_distributed.train.trainer"
)


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left the default process group initialised")
