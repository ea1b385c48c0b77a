"""The ``gloo+shm`` progress queue in one process: jobs run one at a time in submission order,
asynchronous ones on the thread while the caller goes on, a waiting caller's job in its own
thread when nothing is queued; a job's error is the work's error (same exception, also on its
future); closing fails what is queued."""

from __future__ import annotations

import threading
import time

import pytest

from torsh_distributed.runtime._shm_async import Progress, ShmWork
from torsh_distributed.runtime.errors import CommunicationError, DistributedTimeoutError

pytestmark = pytest.mark.timeout(60)


def _work(op: str = "all_reduce(sum)") -> ShmWork:
    return ShmWork([], rank=0, operation=op)


def test_jobs_run_in_submission_order_and_the_caller_goes_on():
    progress = Progress(rank=0, name="t")
    gate = threading.Event()
    order: list[int] = []
    threads: set[str] = set()

    def job(i: int):
        def run() -> None:
            if i == 0:
                assert gate.wait(30), "the caller never released the first job"
            order.append(i)
            threads.add(threading.current_thread().name)

        return run

    works = [progress.submit(job(i), _work(), caller_waits=False) for i in range(5)]
    # the first job blocks until the caller, who got its work back at once, releases it
    assert not any(w.is_completed() for w in works)
    # a waiting caller's job (another thread) queues behind the others and runs after them
    waiter = threading.Thread(
        target=progress.submit, args=(job(5), _work()), kwargs={"caller_waits": True}
    )
    waiter.start()
    deadline = time.monotonic() + 30
    while progress.runs["thread"] < 6 and time.monotonic() < deadline:
        time.sleep(0.001)  # until the waiter has queued its job (counted under the lock)
    gate.set()
    waiter.join(30)
    assert all(w.is_completed() and w.wait() for w in works)
    assert order == [0, 1, 2, 3, 4, 5]
    assert threads == {"torsh-shm-progress-t"}
    assert progress.runs == {"inline": 0, "thread": 6}
    # nothing queued: a waiting caller runs its job itself
    progress.submit(job(6), _work(), caller_waits=True)
    assert threads == {"torsh-shm-progress-t", threading.current_thread().name}
    assert progress.runs == {"inline": 1, "thread": 6}
    assert progress.close()  # the thread stopped


def test_a_jobs_error_is_raised_by_wait_and_set_on_the_future():
    progress = Progress(rank=0, name="t")
    error = DistributedTimeoutError(
        "rank 1 did not reach all_reduce(sum) over shared memory: it did not arrive within 3 s",
        rank=0,
        operation="all_reduce(sum)",
    )

    def fail() -> None:
        raise error

    work = progress.submit(fail, _work(), caller_waits=False)
    with pytest.raises(DistributedTimeoutError) as caught:
        work.wait()
    assert caught.value is error  # the same exception, so the same one-line message
    assert not work.is_success() and work.exception() is error
    with pytest.raises(Exception, match="rank 1 did not reach all_reduce"):
        work.get_future().wait()  # an error of the future, as C++ waits (DDP's reducer) see it
    # a waiting caller whose job runs in its own thread gets the error from the call itself
    with pytest.raises(DistributedTimeoutError) as inline:
        progress.submit(fail, _work(), caller_waits=True)
    assert inline.value is error
    progress.close()


def test_synchronous_mode_runs_every_job_in_the_caller():
    progress = Progress(rank=0, name="t", asynchronous=False)
    seen: list[str] = []
    work = progress.submit(
        lambda: seen.append(threading.current_thread().name), _work(), caller_waits=False
    )
    assert work.is_completed() and seen == [threading.current_thread().name]
    assert progress.runs == {"inline": 1, "thread": 0}


def test_close_fails_queued_jobs_and_refuses_new_ones():
    progress = Progress(rank=0, name="t")
    gate = threading.Event()
    first = progress.submit(lambda: gate.wait(30) and None, _work(), caller_waits=False)
    deadline = time.monotonic() + 30
    while (progress._queue or not progress._running) and time.monotonic() < deadline:
        time.sleep(0.001)  # until the thread has taken the first job (it then blocks on the gate)
    queued = progress.submit(lambda: None, _work("broadcast"), caller_waits=False)
    closer = threading.Thread(target=progress.close, kwargs={"join_s": 30})
    closer.start()
    with pytest.raises(CommunicationError, match="shut down before broadcast ran"):
        queued.wait()
    gate.set()
    closer.join(30)
    assert first.wait() and not closer.is_alive()
    with pytest.raises(CommunicationError, match="process group is shut down"):
        progress.submit(lambda: None, _work(), caller_waits=False)


def test_wait_with_a_timeout_names_the_operation():
    from datetime import timedelta

    progress = Progress(rank=3, name="t")
    gate = threading.Event()
    work = progress.submit(lambda: gate.wait(30) and None, _work("all_gather"), caller_waits=False)
    with pytest.raises(DistributedTimeoutError, match="all_gather over shared memory did not"):
        work.wait(timedelta(milliseconds=50))
    gate.set()
    assert work.wait()
    progress.close()
