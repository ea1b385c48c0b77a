"""How far a run got, beside its checkpoints: what a restart lost.

The main rank records ``{"step", "world_size", "members", "unix_s"}`` in ``progress.json`` of the
checkpoint directory after every step (a rename of a few bytes, no fsync: it is advice, not
state). A run that resumes from the checkpoint of step ``s`` after the previous attempt reached
step ``p`` has lost ``p - s`` steps, which it recomputes; with the previous attempt's members it
also says which nodes left or joined (an elastic job that changed size).

Attempts. Under torch's elastic agent a job restarts its workers (``TORCHELASTIC_RESTART_COUNT``
counts the restarts), and nothing of a dead attempt survives but files. So ``progress.json`` also
holds the job's id and attempt and one entry per attempt so far (:func:`attempt_entry`: where it
started, how far it got, the steps it lost, its saves): a restarted attempt of the same job carries
them on (:func:`carried_attempts`), and the run's summary totals every attempt, not the last one.
A later run in the same directory is another job: it starts a history of its own.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "node_label", "PROGRESS_FILE", "Progress", "read_progress", "record_progress", "describe_restart",
    "JOB_ID_ENV", "job_attempt", "attempt_entry", "carried_attempts", "membership_change",
]

PROGRESS_FILE = "progress.json"


@dataclass(frozen=True, slots=True)
class Progress:
    """The last step a run finished, and who ran it."""

    step: int
    world_size: int
    members: list[dict[str, Any]]
    """One entry per rank: ``{"rank", "node", "host"}``."""
    unix_s: float
    job: str = ""
    """Id of the job that wrote it (see :func:`job_attempt`); empty outside an elastic agent."""
    attempt: int = 0
    """Its attempt: 0, then one more per elastic restart."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """The job's attempts so far, this one last (see :func:`attempt_entry`)."""


def record_progress(
    directory: str | Path,
    *,
    step: int,
    world_size: int,
    members: list[dict[str, Any]],
    job: str = "",
    attempt: int = 0,
    attempts: list[dict[str, Any]] | None = None,
) -> None:
    """Write ``progress.json`` (temporary file + rename: a reader never sees half of it)."""
    path = Path(directory) / PROGRESS_FILE
    tmp = path.with_name(f".{PROGRESS_FILE}.{os.getpid()}.tmp")
    data = {
        "step": step,
        "world_size": world_size,
        "members": members,
        "unix_s": time.time(),
        "job": job,
        "attempt": attempt,
        "attempts": list(attempts or []),
    }
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
            job=str(data.get("job", "")),
            attempt=int(data.get("attempt", 0)),
            attempts=[dict(a) for a in data.get("attempts", []) if isinstance(a, dict)],
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


JOB_ID_ENV = "TORSH_JOB_ID"
"""Set by ``torsh-dist run`` on single-node jobs: an id unique to the launch (several nodes use
torch's ``TORCHELASTIC_RUN_ID``, the ``--rdzv-id`` every node shares)."""


def job_attempt() -> tuple[str, int]:
    """``(job id, attempt)`` of this process: the launch's id and torch's restart count."""
    job = os.environ.get(JOB_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID", "")
    try:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        attempt = 0
    return job, attempt


def attempt_entry(attempt: int, *, resumed_step: int, lost_steps: int) -> dict[str, Any]:
    """A new attempt's entry: where it started and what the restart before it lost;
    ``reached_step``, ``saves`` and ``stall_s`` are updated as it runs."""
    return {
        "attempt": attempt,
        "resumed_step": resumed_step,
        "reached_step": resumed_step,
        "lost_steps": lost_steps,
        "saves": 0,
        "stall_s": 0.0,
    }


def carried_attempts(previous: Progress | None, *, job: str, attempt: int) -> list[dict[str, Any]]:
    """The attempts before this one of the same job (empty for a new job).

    Same job: the same id, and an earlier attempt wrote the file (a later run of the same command
    starts at attempt 0 again). The last entry's ``reached_step`` is set from the file's step.
    """
    if previous is None or previous.job != job or previous.attempt >= attempt:
        return []
    carried = [dict(entry) for entry in previous.attempts]
    if carried:
        carried[-1]["reached_step"] = previous.step
    return carried


def _nodes(members: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for member in members:
        out.setdefault(str(member.get("host", "?")), []).append(int(member.get("rank", -1)))
    return out


def membership_change(previous: Progress, *, world_size: int, members: list[dict[str, Any]]) -> str:
    """``"; world size 6 -> 4; left: ...; joined: ..."``, or ``""`` when nothing changed."""
    if previous.world_size == world_size and _nodes(previous.members).keys() == _nodes(members).keys():
        return ""
    before, now = _nodes(previous.members), _nodes(members)
    left = [f"{h} (ranks {','.join(map(str, r))})" for h, r in before.items() if h not in now]
    joined = [h for h in now if h not in before]
    text = f"; world size {previous.world_size} -> {world_size}"
    if left:
        text += f"; left: {', '.join(left)}"
    if joined:
        text += f"; joined: {', '.join(joined)}"
    return text


def describe_restart(
    previous: Progress, *, resumed_step: int, world_size: int, members: list[dict[str, Any]]
) -> tuple[int, str]:
    """``(lost steps, one line)`` for a run resuming at ``resumed_step`` after ``previous``."""
    lost = max(0, previous.step - resumed_step)
    text = (
        f"the previous attempt reached step {previous.step} at world size "
        f"{previous.world_size}: {lost} step(s) lost, recomputed"
    )
    return lost, text + membership_change(previous, world_size=world_size, members=members)
