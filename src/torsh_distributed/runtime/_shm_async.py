"""Asynchronous operations of the ``gloo+shm`` process group: work objects and a progress thread.

Every shared-memory operation of a group is a job run by one :class:`Progress` queue, in the
order the group's methods were called (first in, first out, one at a time), so the order of
collectives is the program's order on every rank, as the ranks' shared flags require. A call
with ``async_op=True`` (and DDP's bucket all-reduces, which torch makes asynchronous) returns an
:class:`ShmWork` at once and the job runs on the group's progress thread; the C kernels release
the GIL (``ctypes``), so the caller's backward keeps computing meanwhile, as it does beside
Gloo's worker threads. A call whose caller waits anyway (``async_op=False``) runs in the calling
thread when nothing is queued before it (no thread hand-off on the hot path of small
collectives); otherwise it queues behind the earlier jobs and waits.

An error raised by a job (a peer that died or never arrived: the transport's
:class:`~torsh_distributed.runtime.errors.DistributedTimeoutError`) is raised again, the same
exception, by :meth:`ShmWork.wait` and set on the work's future; the jobs queued after it fail
at once (the transport refuses every call after a failure). :meth:`Progress.close` fails what is
still queued and joins the thread before the segment is unmapped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

from torsh_distributed.runtime.errors import CommunicationError, DistributedTimeoutError

__all__ = ["Progress", "ShmWork"]

Job = Callable[[], None]


class ShmWork(dist._Work):
    """An operation of the ``gloo+shm`` group: done when its job has run (see the module)."""

    def __init__(self, result: list[torch.Tensor], *, rank: int, operation: str) -> None:
        super().__init__()
        self._result = result
        self._rank = rank
        self._operation = operation
        self._done = threading.Event()
        self._error: BaseException | None = None
        # torch's Future.set_exception completes the future with the exception as its *value*
        # (only Python's wait() raises it): DDP's reducer, waiting in C++, would take that value
        # for its bucket and crash. An error raised by a ``then`` callback is a real error of
        # the child future, which C++ waits see too (a RuntimeError carrying the message).
        self._base: Future = Future()
        self._future: Future = self._base.then(self._outcome)

    def _outcome(self, _base: Future) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        self._base.set_result(None)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the operation has run; raise its error (the same exception) if it failed.

        The job itself gives up on a missing peer within the group's timeout; ``timeout`` only
        bounds this wait (a job queued behind others may start later).
        """
        limit = None if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        if not self._done.wait(limit):
            raise DistributedTimeoutError(
                f"{self._operation} over shared memory did not complete within {limit:g} s "
                "(Work.wait timeout)",
                rank=self._rank,
                operation=self._operation,
            )
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:  # type: ignore[override]
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> Future:
        return self._future


class Progress:
    """One group's FIFO of shared-memory jobs and the thread that runs them (started lazily).

    Args:
        rank: The group rank (for error messages).
        name: Thread name suffix.
        asynchronous: ``False`` runs every job in the calling thread at submission (the
            behaviour before this module; ``TORSH_SHM_ASYNC=0``), as a baseline to measure
            overlap against. Changing it later takes effect for the next submission.
    """

    def __init__(self, *, rank: int, name: str, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self.busy_s = 0.0
        """Seconds jobs ran (either thread): the group's communication time."""
        self.runs = {"inline": 0, "thread": 0}
        """Jobs run in the calling thread and on the progress thread."""
        self._rank = rank
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[tuple[Job, ShmWork]] = deque()
        self._running = False  # a job runs now (in the thread or inline)
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Job, work: ShmWork, *, caller_waits: bool) -> ShmWork:
        """Run ``job`` after every job submitted before it; ``work`` completes when it has.

        ``caller_waits``: the caller calls ``work.wait()`` at once (``async_op=False``); then
        the job runs here when nothing is queued or running, and an error is raised here.
        """
        with self._cv:
            if self._closed:
                raise CommunicationError(
                    "the gloo+shm process group is shut down",
                    rank=self._rank,
                    operation=work._operation,
                    fix="make a new process group.",
                )
            inline = (
                (caller_waits or not self.asynchronous) and not self._running and not self._queue
            )
            self.runs["inline" if inline else "thread"] += 1
            if inline:
                self._running = True
            else:
                self._queue.append((job, work))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name=f"torsh-shm-progress-{self._name}", daemon=True
                    )
                    self._thread.start()
                self._cv.notify_all()
        if inline:
            try:
                error = self._run(job)
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()
            work._finish(error)
            if error is not None:
                raise error
        elif caller_waits or not self.asynchronous:
            work.wait()
        return work

    def _run(self, job: Job) -> BaseException | None:
        start = time.perf_counter()
        try:
            job()
        except Exception as exc:  # handed to the work: raised by its wait()
            return exc
        finally:
            self.busy_s += time.perf_counter() - start
        return None

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._running or not self._queue):
                    self._cv.wait()
                if not self._queue:  # closed and drained
                    return
                job, work = self._queue.popleft()
                self._running = True
            error = self._run(job)
            with self._cv:
                self._running = False
                self._cv.notify_all()
            work._finish(error)

    def close(self, *, join_s: float = 5.0) -> bool:
        """Refuse new jobs, fail the queued ones, wait up to ``join_s`` for the running one;
        whether the thread has stopped (or never started)."""
        with self._cv:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for _, work in pending:
            work._finish(
                CommunicationError(
                    f"the gloo+shm process group was shut down before {work._operation} ran",
                    rank=self._rank,
                    operation=work._operation,
                )
            )
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_s)
            return not self._thread.is_alive()
        return True
