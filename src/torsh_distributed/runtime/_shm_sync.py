"""Cross-process flags for the shared-memory transport: release stores and acquire waits.

A rank publishes "my data for phase ``k`` is in my slot" by storing ``k`` into its own 64-byte
flag; peers wait until every flag reaches ``k`` before reading. Correctness needs the data stores
to be visible before the flag store (release) and the flag load to happen before the data loads
(acquire). Python cannot say that, so a small C helper does: a full fence then a release store
(the fence also orders the non-temporal stores a large ``memcpy`` may use), and an acquire load
in the wait loop. It is compiled with the system C compiler on first use (about 0.1 s, cached
under ``$TORSH_CACHE_DIR`` or ``~/.cache/torsh_distributed``) and called through ``ctypes``, which
releases the GIL while a rank waits. Without a compiler, x86-64 falls back to plain loads and
stores from Python (its memory model is TSO: stores are not reordered with stores nor loads with
loads, and a Python-level call boundary stops the compiler reordering); other architectures
then refuse the backend.

Waiting polls the flags 8192 times (tens of microseconds), then sleeps in the kernel (a futex
on the laggard's flag, which its owner's store wakes when someone sleeps on it): ranks often
outnumber cores on a shared CPU host, and a polling waiter takes the cycles of the rank it waits
for. There is no ``sched_yield`` phase: beside CPU-bound neighbours a yield gives the core to one
of them for a whole time slice (measured in docs/benchmarks.md). ``TORSH_SHM_CFLAGS`` (e.g.
``-DTORSH_SPINS=1024``) rebuilds the helper with other settings, for such measurements.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from torsh_distributed.runtime._shm_kernels import KERNELS, bind
from torsh_distributed.runtime.errors import FeatureNotAvailableError

__all__ = ["FLAG_BYTES", "Flags", "load_flags"]

FLAG_BYTES = 64  # one cache line per rank: no false sharing between writers
log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <limits.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>
/* Polls of the flags before sleeping on a laggard's futex. No sched_yield phase: beside
   CPU-bound neighbours a yield hands the core to one of them for a whole time slice, so a
   waiter whose peer had long arrived woke milliseconds late (32 MB all-reduce beside one burner
   per core: 0.7x Gloo with 448 yields, 2.9x without; docs/benchmarks.md). */
#ifndef TORSH_SPINS
#define TORSH_SPINS 8192
#endif
/* Experiments (TORSH_SHM_CFLAGS): TORSH_SPIN_NS > 0 bounds the polls by time instead of by
   count (the clock read every 64 polls; the time counts from the call's start, so after a
   futex wake only up to 63 polls come before the next sleep); TORSH_PAUSE=1 issues x86's PAUSE
   in each poll. Measured without gain (docs/benchmarks.md). */
#ifndef TORSH_SPIN_NS
#define TORSH_SPIN_NS 0
#endif
#ifndef TORSH_PAUSE
#define TORSH_PAUSE 0
#endif

/* The futex word is the low half of a flag (the counter's low 32 bits change every phase). */
static int32_t *word(int64_t *p) {
    return (int32_t *)p + (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__);
}

/* p[1] (same cache line) counts the ranks asleep on p: the store wakes only when there are some.
   Both sides are sequentially consistent (store flag / load sleepers against add sleepers /
   load flag), so a sleeper either sees the new value or is counted and woken. */
void torsh_store(int64_t *p, int64_t v) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(p + 1, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, word(p), FUTEX_WAKE, INT_MAX, 0, 0, 0);
}

int64_t torsh_load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* Wait until base[i * stride] >= target for every i < n, for at most budget_ns.
   Returns -1 when all arrived, else the first index that has not. Spins briefly, then sleeps
   in the kernel on the laggard's flag until its owner's store wakes it (or 10 ms pass). */
int torsh_wait_all(int64_t *base, int stride, int n, int64_t target, int64_t budget_ns) {
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int first = 0;
    for (uint64_t spin = 0;; spin++) {
        while (first < n && __atomic_load_n(base + (int64_t)first * stride, __ATOMIC_ACQUIRE) >= target)
            first++;
        if (first == n) return -1;
#if TORSH_PAUSE && (defined(__x86_64__) || defined(__i386__))
        __builtin_ia32_pause();
#endif
#if TORSH_SPIN_NS > 0
        if (spin & 63) continue;
#else
        if (spin < TORSH_SPINS) continue;
#endif
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t spent = (now.tv_sec - t0.tv_sec) * 1000000000LL + (now.tv_nsec - t0.tv_nsec);
        if (spent >= budget_ns) return first;
#if TORSH_SPIN_NS > 0
        if (spent < TORSH_SPIN_NS) continue;
#endif
        int64_t *flag = base + (int64_t)first * stride;
        int32_t seen = __atomic_load_n(word(flag), __ATOMIC_SEQ_CST);
        __atomic_add_fetch(flag + 1, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(flag, __ATOMIC_SEQ_CST) < target) {
            int64_t left = budget_ns - spent;
            if (left > 10000000LL) left = 10000000LL;
            struct timespec nap = {0, (long)left};
            syscall(SYS_futex, word(flag), FUTEX_WAIT, seen, &nap, 0, 0);
        }
        __atomic_sub_fetch(flag + 1, 1, __ATOMIC_SEQ_CST);
    }
}
"""


def _cache_dir() -> Path:
    root = os.environ.get("TORSH_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torsh_distributed"
    )
    return Path(root)


_EXTRA_FLAGS = [f for f in os.environ.get("TORSH_SHM_CFLAGS", "").split() if f]  # experiments


def _compile() -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    source = _SOURCE + KERNELS
    digest = hashlib.sha256(
        (source + platform.machine() + " ".join(_EXTRA_FLAGS)).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"shm_sync-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "shm_sync.c"
        src.write_text(source)
        out = Path(tmp) / "shm_sync.so"
        done = subprocess.run(
            [compiler, "-O3", "-ffp-contract=off", *_EXTRA_FLAGS, "-shared", "-fPIC", "-o", str(out),
             str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            if _EXTRA_FLAGS:  # an experiment's flags broke the build: say so, not "no compiler"
                log.warning(
                    "gloo+shm: the C helper did not compile with TORSH_SHM_CFLAGS=%r: %s",
                    " ".join(_EXTRA_FLAGS),
                    done.stderr.strip()[-2000:],
                )
            return None
        os.replace(out, target)  # atomic: ranks compiling at once all end with a whole file
    return target


class Flags:
    """``n`` int64 flags, one per cache line, at ``address`` (inside a mapped segment)."""

    def __init__(self, address: int, n: int, lib: ctypes.CDLL | None) -> None:
        self._address = address
        self._n = n
        self._lib = lib
        self._stride = FLAG_BYTES // 8
        self._cells = [ctypes.c_int64.from_address(address + i * FLAG_BYTES) for i in range(n)]

    @property
    def address(self) -> int:
        """Where flag 0 is (the others follow every ``FLAG_BYTES``)."""
        return self._address

    def store(self, index: int, value: int) -> None:
        """Publish ``value`` in flag ``index`` after every earlier store of this process."""
        if self._lib is not None:
            self._lib.torsh_store(self._address + index * FLAG_BYTES, value)
        else:
            self._cells[index].value = value

    def load(self, index: int) -> int:
        if self._lib is not None:
            return int(self._lib.torsh_load(self._address + index * FLAG_BYTES))
        return int(self._cells[index].value)

    def wait_all(self, target: int, budget_s: float) -> int:
        """Wait up to ``budget_s`` for every flag to reach ``target``; -1 or the first laggard."""
        if self._lib is not None:
            return int(
                self._lib.torsh_wait_all(
                    self._address, self._stride, self._n, target, int(budget_s * 1e9)
                )
            )
        end = time.monotonic() + budget_s
        spins = 0
        while True:
            lagging = next((i for i, c in enumerate(self._cells) if c.value < target), -1)
            if lagging < 0 or time.monotonic() >= end:
                return lagging
            spins += 1
            if spins >= 64:  # a few polls, then short sleeps (no yields: see the module docstring)
                time.sleep(5e-5)


_LIB: ctypes.CDLL | None = None
_LOADED = False


def load_flags() -> ctypes.CDLL | None:
    """The compiled helper, or ``None`` for the x86-64 Python fallback.

    Raises:
        FeatureNotAvailableError: no C compiler and not x86-64 (no safe fallback).
    """
    global _LIB, _LOADED
    if _LOADED:
        return _LIB
    path = None if os.environ.get("TORSH_SHM_NO_CC") == "1" else _compile()
    if path is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise FeatureNotAvailableError(
                f"the shared-memory backend needs a C compiler on {platform.machine()} "
                "(memory fences for cross-process flags)",
                operation="shm init",
                fix="install gcc (or set CC), or use backend='gloo'.",
            )
        log.warning(
            "gloo+shm: the C flag helper could not be built (no compiler, or TORSH_SHM_NO_CC=1): "
            "using the x86-64 Python fallback (polling, more CPU while waiting)"
        )
    else:
        lib = ctypes.CDLL(str(path))
        lib.torsh_store.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.torsh_store.restype = None
        lib.torsh_load.argtypes = [ctypes.c_void_p]
        lib.torsh_load.restype = ctypes.c_int64
        lib.torsh_wait_all.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_int64,
        ]
        lib.torsh_wait_all.restype = ctypes.c_int
        bind(lib)
        _LIB = lib
    _LOADED = True
    return _LIB
