"""A job that changes its world size between segments: the launcher side and the job side.

torch's elastic agent keeps a node's worker count for the life of the agent; the world size
changes only when nodes join or leave. A job that wants another size on the same node (carbon-
aware scaling: more workers while the grid is clean) runs in *segments*: :func:`launch_resizing`
starts one with :func:`~torsh_distributed.elastic.launch.launch` at the size ``choose`` gives
now; the job checkpoints, appends its record to the segment log and ends with every worker
succeeding; when that record asks for a new size, the launcher starts the next segment (which
resumes from the checkpoint), else the job is done. Each segment is a full launch, with its own
restarts (``max_restarts``) should a worker fail.

The job finds its segment in the environment (:func:`current_segment`): the log's path, this
segment's index, size and range, when the launcher started it and why it chose that size. Only
the job's rank 0 writes the log, one JSON line per segment (:func:`append_record`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torsh_distributed.elastic._options import LaunchOptions

__all__ = ["SEGMENT_ENV", "Segment", "append_record", "current_segment", "launch_resizing", "read_records"]

SEGMENT_ENV = "TORSH_RESIZE_SEGMENT"
"""Set by :func:`launch_resizing` for the workers: this segment as JSON (see :class:`Segment`)."""

Choose = Callable[[float], tuple[int, dict[str, Any]]]
"""``choose(unix time) -> (world size, why)``: the size to launch at now, and a JSON-able reason
(its ``text``, if any, is printed with the launch)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One launch of a resizing job, as its workers see it."""

    index: int
    """0 for the first launch, one more per change of size."""
    world_size: int
    sizes: list[int]
    """The sizes the job may run at, ascending."""
    launched_unix_s: float
    """When the launcher started it: the first step minus this is what a restart costs."""
    why: dict[str, Any]
    """What the launcher's ``choose`` said (for carbon scaling: the intensity)."""
    log: str
    """The segment log (JSON lines; the job's rank 0 appends one record per segment)."""

    @property
    def min_size(self) -> int:
        return self.sizes[0]

    @property
    def max_size(self) -> int:
        return self.sizes[-1]


def current_segment(environ: Mapping[str, str] | None = None) -> Segment | None:
    """This process's segment, or ``None`` when not launched by :func:`launch_resizing`."""
    raw = (os.environ if environ is None else environ).get(SEGMENT_ENV)
    if not raw:
        return None
    data = json.loads(raw)
    return Segment(**{f.name: data[f.name] for f in dataclasses.fields(Segment)})


def read_records(log: str | Path) -> list[dict[str, Any]]:
    """Every segment's record, oldest first (``[]`` when none was written)."""
    try:
        lines = Path(log).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def append_record(log: str | Path, record: Mapping[str, Any]) -> None:
    """Append one segment's record (rank 0 only; one write of one line)."""
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")


def launch_resizing(
    options: LaunchOptions,
    *,
    choose: Choose,
    sizes: Sequence[int],
    module: str,
    args: Sequence[str] = (),
    write: Callable[[str], None] = print,
) -> int:
    """Run ``python -m module args`` on this node in segments whose worker count ``choose``
    gives at each launch (see the module doc). One node only.

    Args:
        options: Launch options; ``nproc_per_node`` is replaced by each segment's size.
        choose: The size to launch at now, and why (see :data:`Choose`); one of ``sizes``.
        sizes: The worker counts the job may run at.
        module: The job's module (``python -m``).
        args: Its arguments.
        write: Prints a line (each launch's size and why).

    Returns:
        The first non-zero exit status of a segment, else 0 once a segment ends without asking
        for another size.

    Raises:
        ValueError: more than one node, or ``choose`` gave a size not in ``sizes``.
    """
    from torsh_distributed.elastic.launch import launch

    allowed = sorted(set(sizes))
    if options.max_nodes != 1:
        raise ValueError(f"resizing runs on one node, got nnodes={options.nnodes!r}")
    work = tempfile.mkdtemp(prefix="torsh-resize-")
    log = os.path.join(work, "segments.jsonl")
    try:
        index = 0
        while True:
            now = time.time()
            size, why = choose(now)
            if size not in allowed:
                raise ValueError(f"choose gave world size {size}, not one of {allowed}")
            segment = Segment(index=index, world_size=size, sizes=allowed, launched_unix_s=now,
                              why=dict(why), log=log)
            reason = why.get("text", "")
            write(f"torsh-dist: segment {index}: {size} worker(s){f' ({reason})' if reason else ''}")
            sys.stdout.flush()
            env = {**options.env, SEGMENT_ENV: json.dumps(dataclasses.asdict(segment))}
            code = launch(dataclasses.replace(options, nproc_per_node=size, env=env),
                          module=module, args=args)
            records = read_records(log)
            if code or len(records) <= index or not records[index].get("stop"):
                return code
            index += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
