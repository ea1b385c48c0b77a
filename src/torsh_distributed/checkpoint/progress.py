"""How far a run got, beside its checkpoints: what a restart lost.

The main rank records ``{"step", "world_size", "members", "unix_s"}`` in ``progress.json`` of the
checkpoint directory after every step (a rename of a few bytes, no fsync: it is advice, not
state). A run that resumes from the checkpoint of step ``s`` after the previous attempt reached
step ``p`` has lost ``p - s`` steps, which it recomputes; with the previous attempt's members it
also says which nodes left or joined (an elastic job that changed size).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["node_label", "PROGRESS_FILE", "Progress", "read_progress", "record_progress", "describe_restart"]

PROGRESS_FILE = "progress.json"


@dataclass(frozen=True, slots=True)
class Progress:
    """The last step a run finished, and who ran it."""

    step: int
    world_size: int
    members: list[dict[str, Any]]
    """One entry per rank: ``{"rank", "node", "host"}``."""
    unix_s: float


def record_progress(
    directory: str | Path, *, step: int, world_size: int, members: list[dict[str, Any]]
) -> None:
    """Write ``progress.json`` (temporary file + rename: a reader never sees half of it)."""
    path = Path(directory) / PROGRESS_FILE
    tmp = path.with_name(f".{PROGRESS_FILE}.{os.getpid()}.tmp")
    data = {"step": step, "world_size": world_size, "members": members, "unix_s": time.time()}
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass  # advice only: a full or read-only disk must not stop training (saves will say so)


def read_progress(directory: str | Path) -> Progress | None:
    """The recorded progress, or ``None`` when there is none (or it cannot be read)."""
    try:
        data = json.loads((Path(directory) / PROGRESS_FILE).read_text())
        return Progress(
            step=int(data["step"]),
            world_size=int(data["world_size"]),
            members=list(data.get("members", [])),
            unix_s=float(data.get("unix_s", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


NODE_ADDR_ENV = "TORSH_NODE_ADDR"
"""Set by ``torsh-dist run`` on multi-node jobs: this node's address toward the master."""


def node_label() -> str:
    """This node's name for reports: the host name, plus its address on multi-node jobs (host
    names alone can coincide: containers, or the network lab's namespaces)."""
    host = socket.gethostname()
    addr = os.environ.get(NODE_ADDR_ENV)
    return f"{host} ({addr})" if addr else host


def _nodes(members: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for member in members:
        out.setdefault(str(member.get("host", "?")), []).append(int(member.get("rank", -1)))
    return out


def describe_restart(
    previous: Progress, *, resumed_step: int, world_size: int, members: list[dict[str, Any]]
) -> tuple[int, str]:
    """``(lost steps, one line)`` for a run resuming at ``resumed_step`` after ``previous``."""
    lost = max(0, previous.step - resumed_step)
    text = (
        f"the previous attempt reached step {previous.step} at world size "
        f"{previous.world_size}: {lost} step(s) lost, recomputed"
    )
    if previous.world_size != world_size or _nodes(previous.members).keys() != _nodes(members).keys():
        before, now = _nodes(previous.members), _nodes(members)
        left = [f"{h} (ranks {','.join(map(str, r))})" for h, r in before.items() if h not in now]
        joined = [h for h in now if h not in before]
        text += f"; world size {previous.world_size} -> {world_size}"
        if left:
            text += f"; left: {', '.join(left)}"
        if joined:
            text += f"; joined: {', '.join(joined)}"
    return lost, text
