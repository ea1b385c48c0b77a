"""A rank's process-group teardown after its call (:func:`~torsh_distributed.launch._workers.run_rank`):
synchronous, or, after a failure where the launcher ends the process anyway, in a thread that
the outcome does not wait for (the driver hears of the failure at once)."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["CLEANUP_WAIT_S", "finish_cleanup"]

log = logging.getLogger(__name__)

CLEANUP_WAIT_S = 1.0
"""After a rank failed, how long :func:`run_rank` waits for its process group's teardown before
it returns the outcome anyway (the teardown goes on in a thread)."""
_CLEANUP: list[threading.Thread] = []  # a teardown still running after its rank's call returned


def _clean_up(wait_s: float | None) -> float | None:
    """Destroy the call's process group; its duration in seconds, or ``None`` when it was still
    running after ``wait_s`` (``None``: wait for it) or an earlier one still is."""
    start = time.monotonic()
    if any(thread.is_alive() for thread in _CLEANUP):
        return None  # an earlier teardown is stuck (this call failed waiting for it): not twice
    if wait_s is None:
        _destroy_group_logged()
        return time.monotonic() - start
    device = _cuda_device()

    def teardown() -> None:
        if device is not None:  # the current device is per thread: the rank's, not device 0
            import torch

            torch.cuda.set_device(device)
        _destroy_group_logged()

    thread = threading.Thread(target=teardown, name="torsh-launch-cleanup", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had: tear down here
        _destroy_group_logged()
        return time.monotonic() - start
    thread.join(wait_s)
    if thread.is_alive():
        _CLEANUP.append(thread)
        return None
    return time.monotonic() - start


def _cuda_device() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def _await_cleanup(limit_s: float) -> None:
    """Wait for a teardown that an earlier failed call left running in this process."""
    deadline = time.monotonic() + limit_s
    while _CLEANUP:
        _CLEANUP[0].join(max(deadline - time.monotonic(), 0.0))
        if _CLEANUP[0].is_alive():
            raise RuntimeError(
                f"the process group of an earlier job in this worker process is still being "
                f"torn down after {limit_s:g} s (start_timeout_s); restart the worker"
            )
        _CLEANUP.pop(0)


def finish_cleanup(limit_s: float) -> bool:
    """Wait up to ``limit_s`` for a teardown that :func:`run_rank` left running (a process about
    to exit calls this: the interpreter's exit under a thread inside torch's teardown can crash
    it); whether none is left."""
    try:
        _await_cleanup(limit_s)
    except RuntimeError:
        return False
    return True


def _destroy_group_logged() -> None:
    try:
        _destroy_group()
    except Exception as exc:  # noqa: BLE001 - a failed teardown must not replace the outcome
        log.warning("launch: destroying the process group failed: %s: %s", type(exc).__name__, exc)


def _destroy_group() -> None:
    import torch.distributed as dist

    from torsh_distributed.runtime import world

    world.shutdown()
    if dist.is_available() and dist.is_initialized():  # created by the user's function itself
        dist.destroy_process_group()
