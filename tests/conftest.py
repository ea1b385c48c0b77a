"""Suite-wide settings: no test may leave a process group or stray env behind."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

# Worker processes of the harness import the package from the preloaded forkserver;
# quiet torch's C++ warnings about gloo interfaces on machines without a hostname entry.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# Most ranks train through the engine: the harness's forkserver imports it once per session
# instead of every rank of every test importing it again (~2 s per run on 2 cores).
os.environ.setdefault(
    "TORSH_TEST_PRELOAD", "torsh_distributed.engine.engine,torsh_distributed.train.trainer"
)


# --- the longest test files first (docs/testing.md, "Suite time") ---------------------------------
DURATIONS = Path(__file__).with_name("durations.json")


def longest_files_first(items: list[pytest.Item], table: dict[str, float]) -> None:
    """Sort ``items`` in place by their file's duration in ``table``, longest first, each file's
    tests kept together and in their order; a file missing from the table counts the median."""
    default = statistics.median(table.values()) if table else 0.0
    items.sort(key=lambda item: -table.get(item.nodeid.split("::", 1)[0], default))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, `make test`'s workers (`--dist loadfile --no-loadscope-reorder`) take
    whole files in collection order: longest first (tests/durations.json, written by
    scripts/test_durations.py from a run), so the files a worker starts last are short ones and
    the workers end together. xdist's own order puts the files with the most tests first, which
    left the few long end-to-end files for last."""
    if "PYTEST_XDIST_WORKER" in os.environ and DURATIONS.is_file():
        longest_files_first(items, json.loads(DURATIONS.read_text()))


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left the default process group initialised")


# --- TORSH_TEST_CPU_LOG=FILE: what each test costs in CPU (docs/testing.md, "Suite time") ---------
_CPUACCT = "/sys/fs/cgroup/cpuacct"


def _cgroup_usage(group: str) -> float:
    with open(os.path.join(group, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def _share_cores_with_the_other_workers() -> None:
    """Under pytest-xdist, each worker's own torch work (tests that compute in this process) runs
    on its share of the cores, as the harness gives each rank its share: torch's default is every
    core per process, and two workers' thread pools on 2 cores spin in OpenMP's waits while the
    other worker runs. ``OMP_NUM_THREADS``, when set, is left to decide."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        from torsh_distributed.runtime.busy import usable_cores

        torch.set_num_threads(max(1, usable_cores() // workers))


def pytest_configure(config: pytest.Config) -> None:
    _share_cores_with_the_other_workers()
    _measure_cpu(config)


def _measure_cpu(config: pytest.Config) -> None:
    """Each pytest process (an xdist worker too) moves into a cgroup of its own; every process it
    starts (ranks, launchers, servers, forkservers: wherever they are reaped) stays in it, so its
    CPU counter is exactly what this process's tests cost, even beside another worker. Linux with
    cgroup v1 ``cpuacct`` and root only; a measuring aid, off unless the variable is set."""
    if not os.environ.get("TORSH_TEST_CPU_LOG"):
        return
    group = os.path.join(_CPUACCT, f"torsh-test-{os.getpid()}")
    try:
        os.makedirs(group, exist_ok=True)
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as exc:
        raise pytest.UsageError(f"TORSH_TEST_CPU_LOG needs root and {_CPUACCT}: {exc}") from exc
    config.stash[_CPU_GROUP] = group


_CPU_GROUP = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    """One line per test in TORSH_TEST_CPU_LOG: ``cpu_s wall_s nodeid end_unix_s worker`` (set-up
    and teardown included: a module fixture counts in its module's first test; the end time and
    the xdist worker show how the workers' time lines end)."""
    group = item.config.stash.get(_CPU_GROUP, None)
    if group is None:
        yield
        return
    import time

    c0, w0 = _cgroup_usage(group), time.monotonic()
    yield
    with open(os.environ["TORSH_TEST_CPU_LOG"], "a") as out:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        cpu, wall = _cgroup_usage(group) - c0, time.monotonic() - w0
        out.write(f"{cpu:.2f} {wall:.2f} {item.nodeid} {time.time():.1f} {worker}\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    group = config.stash.get(_CPU_GROUP, None)
    if group is None:
        return
    try:  # back to the root group; the directory goes once nothing started here is left
        with open(os.path.join(_CPUACCT, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(group)
    except OSError:
        pass
