"""POSIX shared-memory segments of the shm backend: naming, creation, attach, unlink, stale cleanup.

A node's group shares one segment, ``/dev/shm/torsh-shm-<creator pid>-<128-bit random token>``,
created by the group's first rank with ``O_CREAT | O_EXCL`` and mode ``0600`` (only this user can
open it; the random token, sent to the peers through the job's store, keeps another job of the
same user from guessing it). Every rank maps it and writes its pid into the header; once all have
mapped it the creator unlinks the name, so from then on no exit path (``SIGKILL`` included) can
leave it behind: the memory goes away with the last mapping. Only the short window between
creation and the last attach needs help: the creator unlinks at exit (``atexit``) and on
``SIGTERM``, and :func:`cleanup_stale_segments` (run by every creator before it creates) removes
our-prefixed segments of this user whose creator and attached pids are all dead.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import signal
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PREFIX", "SHM_DIR", "Segment", "cleanup_stale_segments", "new_name"]

SHM_DIR = Path("/dev/shm")
PREFIX = "torsh-shm-"
MAGIC = b"TORSHSHM"
HEADER_BYTES = 4096
_PID_OFFSET = 64
_MAX_RANKS = (HEADER_BYTES - _PID_OFFSET) // 8

_pending: set[Path] = set()  # created here and not yet unlinked
_lock = threading.Lock()
_previous_sigterm: object = None


def new_name() -> str:
    """A fresh, unguessable segment name for this process to create."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    try:  # a killed child its parent has not reaped yet is a zombie: dead for us
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def _unlink_pending() -> None:
    with _lock:
        for path in list(_pending):
            path.unlink(missing_ok=True)
            _pending.discard(path)


def _on_sigterm(signum: int, frame: object) -> None:
    _unlink_pending()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _guard(path: Path) -> None:
    global _previous_sigterm
    with _lock:
        _pending.add(path)
    if threading.current_thread() is threading.main_thread() and _previous_sigterm is None:
        current = signal.getsignal(signal.SIGTERM)
        if current is not _on_sigterm:
            _previous_sigterm = current if current is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, _on_sigterm)


atexit.register(_unlink_pending)


def cleanup_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink this user's ``torsh-shm-*`` segments whose creator and every attached rank are dead.

    Returns the names removed. A segment of a live job (any of its pids alive) is left alone.
    """
    removed = []
    uid = os.getuid()
    for path in directory.glob(f"{PREFIX}*"):
        try:
            if path.stat().st_uid != uid:
                continue
            creator = int(path.name[len(PREFIX) :].split("-", 1)[0])
            pids = [creator]
            with open(path, "rb") as fh:
                head = fh.read(HEADER_BYTES)
            if len(head) >= _PID_OFFSET and head[:8] == MAGIC:
                count = struct.unpack_from("<I", head, 12)[0]
                count = min(count, _MAX_RANKS)
                pids += list(struct.unpack_from(f"<{count}q", head, _PID_OFFSET))
            if any(_alive(p) for p in pids):
                continue
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except (OSError, ValueError, struct.error):
            continue
    return removed


@dataclass(slots=True)
class Segment:
    """One mapped segment. ``data_offset`` is where the flags start (the header comes first)."""

    name: str
    size: int
    num_ranks: int
    mm: mmap.mmap
    created: bool

    @classmethod
    def create(cls, name: str, *, size: int, num_ranks: int, directory: Path = SHM_DIR) -> Segment:
        if num_ranks > _MAX_RANKS:
            raise ValueError(f"at most {_MAX_RANKS} ranks per node, got {num_ranks}")
        path = directory / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _guard(path)
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: a /dev/shm too small for the segment (docker's default is
            # 64 MiB) fails here with ENOSPC, not later with SIGBUS inside a collective.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _unlink_pending()
            raise
        finally:
            os.close(fd)
        mm[8:16] = struct.pack("<II", 1, num_ranks)
        mm[0:8] = MAGIC
        return cls(name=name, size=size, num_ranks=num_ranks, mm=mm, created=True)

    @classmethod
    def attach(cls, name: str, *, size: int, num_ranks: int, directory: Path = SHM_DIR) -> Segment:
        fd = os.open(directory / name, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"segment {name} has the wrong size")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name=name, size=size, num_ranks=num_ranks, mm=mm, created=False)

    def set_pid(self, index: int, pid: int) -> None:
        struct.pack_into("<q", self.mm, _PID_OFFSET + 8 * index, pid)

    def pid(self, index: int) -> int:
        return struct.unpack_from("<q", self.mm, _PID_OFFSET + 8 * index)[0]

    def unlink(self, directory: Path = SHM_DIR) -> None:
        """Remove the name (mappings stay valid). Safe to call twice or from a non-creator."""
        path = directory / self.name
        path.unlink(missing_ok=True)
        with _lock:
            _pending.discard(path)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a tensor view still exists: the mapping goes with the process
            pass
