"""Whole lines in the launcher's rank-prefixed output.

torch's elastic agent echoes each worker's log file through
:func:`torch.distributed.elastic.multiprocessing.tail_log.tail_logfile`, which writes whatever
``readline()`` returns, a partial line at the end of the file included, with the rank's prefix.
A worker caught between writing a line and its newline (``print`` makes two writes when the
stream is unbuffered) then comes out as ``[rank0]: text`` with no newline, another rank's line
glued to it, and ``[rank0]: `` with the newline later: seen in CI beside load, where
``[rank0]: final loss ...[rank1]: final loss ...`` broke a test that reads each rank's last line.

:func:`tail_whole_lines` is torch's function with one change: a partial line waits for the rest
(or for the worker's end, when it is written with a newline added). :func:`install` puts it in
torch's module, where :class:`~torch.distributed.elastic.multiprocessing.tail_log.TailLog` looks
it up, in the launcher's process only; it leaves a torch whose function has another signature
alone.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from threading import Event
from typing import TextIO

__all__ = ["install", "tail_whole_lines"]

_TORCH_PARAMS = ["header", "file", "dst", "finished", "interval_sec", "log_line_filter"]


def tail_whole_lines(
    header: str,
    file: str,
    dst: TextIO,
    finished: Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """Echo ``file`` to ``dst`` a whole line at a time, each after ``header``, until
    ``finished`` is set and the file is read to its end."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)

    def emit(line: str) -> None:
        if log_line_filter is None or log_line_filter(line):
            dst.write(f"{header}{line}")

    pending = ""
    with open(file, errors="replace") as fp:
        while True:
            chunk = fp.readline()
            if chunk:
                pending += chunk
                if pending.endswith("\n"):
                    emit(pending)
                    pending = ""
            elif finished.is_set():
                break
            else:
                time.sleep(interval_sec)
    if pending:  # the worker ended mid-line: keep what it wrote
        emit(pending + "\n")


def install() -> bool:
    """Make torch's ``TailLog`` use :func:`tail_whole_lines`; False (nothing changed) when
    torch's function is not the one this replaces."""
    from torch.distributed.elastic.multiprocessing import tail_log

    current = tail_log.tail_logfile
    if current is tail_whole_lines:
        return True
    if list(inspect.signature(current).parameters) != _TORCH_PARAMS:
        return False
    tail_log.tail_logfile = tail_whole_lines
    return True
