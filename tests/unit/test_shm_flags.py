"""The cross-process flags of the shm backend, in one process: the compiled helper and the x86-64
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
    assert 0.04 <= time.monotonic() - start < 1.0
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
    assert flags.wait_all(1, 5.0) == -1
    elapsed = time.monotonic() - start
    timer.join()
    assert 0.15 <= elapsed < 2.0
