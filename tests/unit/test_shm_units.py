"""Single-process checks of the shm backend. The cross-process flags: the compiled helper and the x86-64
Python fallback both publish, load and wait with a deadline, and a waiter returns as soon as another
thread stores the flag (the wait releases the GIL; a waiter holding it would reach its deadline)."""

from __future__ import annotations

import ctypes
import mmap
import platform
import threading
import time

import pytest

from torsh_distributed.runtime._shm_sync import FLAG_BYTES, Flags, load_flags

HELPERS = ["compiled"]
if platform.machine().lower() in ("x86_64", "amd64"):
    HELPERS.append("python")


def _flags(kind: str, n: int) -> tuple[Flags, mmap.mmap]:
    mm = mmap.mmap(-1, 4096)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return Flags(address, n, load_flags() if kind == "compiled" else None), mm


@pytest.mark.parametrize("kind", HELPERS)
def test_store_load_and_wait_with_a_deadline(kind):
    if kind == "compiled" and load_flags() is None:
        pytest.skip("no C compiler here")
    flags, _mm = _flags(kind, 3)
    assert FLAG_BYTES == 64
    flags.store(0, 5)
    flags.store(1, 6)
    start = time.monotonic()
    assert flags.wait_all(5, 0.05) == 2  # rank 2 never arrived: named after the budget
    assert time.monotonic() - start >= 0.04  # waited its budget (no upper bound: load)
    flags.store(2, 7)
    assert flags.wait_all(5, 0.05) == -1
    assert [flags.load(i) for i in range(3)] == [5, 6, 7]


@pytest.mark.parametrize("kind", HELPERS)
def test_a_waiter_is_woken_by_the_store(kind):
    if kind == "compiled" and load_flags() is None:
        pytest.skip("no C compiler here")
    flags, _mm = _flags(kind, 2)
    flags.store(0, 1)
    timer = threading.Timer(0.2, flags.store, (1, 1))
    timer.start()
    start = time.monotonic()
    assert flags.wait_all(1, 60.0) == -1  # a waiter holding the GIL would time out instead
    elapsed = time.monotonic() - start
    timer.join()
    assert elapsed >= 0.15


@pytest.fixture
def _torch_backend_registry():
    """Leave torch's backend registry as it was (this process runs other tests after us)."""
    import torch.distributed as dist

    B = dist.Backend
    saved = (
        dict(B._plugins),
        list(B.backend_list),
        dict(B.backend_type_map),
        dict(B.backend_capability),
        dict(B.default_device_backend_map),
    )
    yield
    B._plugins, B.backend_list, B.backend_type_map = saved[0], saved[1], saved[2]
    B.backend_capability, B.default_device_backend_map = saved[3], saved[4]


def test_gloo_shm_is_a_backend_name_everywhere_a_backend_is_taken(_torch_backend_registry):
    import torch.distributed as dist

    from torsh_distributed.engine.config import EngineConfig
    from torsh_distributed.runtime.world import resolve_backend

    assert resolve_backend("GLOO+SHM") == "gloo+shm"
    assert "GLOO+SHM" in dist.Backend._plugins  # registered on demand, for init_process_group
    assert EngineConfig(backend="gloo+shm").backend == "gloo+shm"
    with pytest.raises(ValueError, match="backend must be one of auto, gloo, nccl, gloo\\+shm"):
        EngineConfig(backend="shm")
    with pytest.raises(ValueError, match="unknown backend 'shm'; choose one of .*gloo\\+shm"):
        resolve_backend("shm")


@pytest.mark.parametrize("value", ["1000", "abc", "-4096"])
def test_a_bad_slot_size_is_refused_before_any_group_is_made(monkeypatch, value):
    from torsh_distributed.runtime._shm_backend import create

    monkeypatch.setenv("TORSH_SHM_SLOT_BYTES", value)
    with pytest.raises(
        ValueError, match=f"TORSH_SHM_SLOT_BYTES must be a positive multiple of 4096, got '{value}'"
    ):
        create(None, None)


def test_fitted_slot_takes_at_most_a_quarter_of_the_free_space(tmp_path):
    import os

    from torsh_distributed.runtime._shm_backend import MIN_FITTED_SLOT_BYTES, fitted_slot

    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    huge = 1 << 50
    fit = fitted_slot(huge, 4, directory=str(tmp_path))
    assert fit % 4096 == 0 and MIN_FITTED_SLOT_BYTES <= fit < huge
    assert 2 * 4 * fit <= max(free // 4, 2 * 4 * MIN_FITTED_SLOT_BYTES)
    assert fitted_slot(8192, 4, directory=str(tmp_path)) == 8192  # never above what was asked
    assert fitted_slot(1 << 23, 2, directory=str(tmp_path / "missing")) == 1 << 23
