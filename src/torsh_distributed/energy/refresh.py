"""A ``--carbon.series`` file that may change while the job runs (a forecast refreshed by
another job): rank 0's time shifting and scaling, and the scaling launcher, read it again when
it changes.

:class:`SeriesWatch` notices a change by the file's identity (device, inode, size, modification
time), so a file replaced by a rename (write a new file, then ``mv`` it over the old one: the
way to update it, since a reader never sees half of it) and a file rewritten in place both
count. A changed file that does not parse (half written, or wrong) is reported once and the
series read before stays in force. Looking costs one ``stat``; the loops look at least every
``--carbon.refresh`` seconds (:func:`cap_gap`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["SeriesWatch", "cap_gap"]

P = TypeVar("P")


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class SeriesWatch(Generic[P]):
    """Builds a new policy when the series file changed; ``None`` when it did not.

    Args:
        path: The series file (``--carbon.series``).
        build: Reads the file and builds the policy (raises ``ValueError`` or ``OSError`` on a
            file that does not parse).
        write: Prints a line (rank 0's): the refreshed series, or why a change was not taken.
    """

    def __init__(self, path: str, build: Callable[[], P], write: Callable[[str], None] = print) -> None:
        self.path, self.build, self.write = path, build, write
        self._seen = _identity(path)
        self.reloads = 0

    def __call__(self) -> P | None:
        seen = _identity(self.path)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            policy = self.build()
        except (OSError, ValueError) as exc:
            self.write(f"carbon: {self.path} changed but cannot be read ({exc}); keeping the series read before")
            return None
        self.reloads += 1
        self.write(f"carbon: {self.path} changed: following the new series")
        return policy


def cap_gap(gap: int, *, every_s: float, step_s: float) -> int:
    """Steps to the next check, at most ``every_s`` seconds of steps away (at least 1 step);
    ``every_s`` infinite or 0: ``gap`` unchanged (no refresh)."""
    if every_s <= 0 or every_s == float("inf"):
        return gap
    return max(1, min(gap, int(every_s / max(step_s, 1e-9))))
