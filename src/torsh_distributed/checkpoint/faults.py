"""Fault injection for tests and benchmarks, driven by the ``TORSH_FAULT`` environment variable.

``TORSH_FAULT`` holds comma-separated faults ``KIND:key=value:...``:

* ``kill:rank=R:step=S``: rank R sends itself SIGKILL after completing step S;
* ``kill-in-save:rank=R:step=S``: rank R sends itself SIGKILL right after starting the save of
  step S (an asynchronous save is then still being written);
* ``slow:rank=R:ms=M``: rank R sleeps M milliseconds in every step (a straggler);
* ``kill-in-replication:rank=R:step=S``: rank R sends itself SIGKILL after writing the first file
  of a peer's replica of step S (``checkpoint.peer_replicas``): a half-written replica;
* ``stop:rank=R:step=S``: rank R sends itself SIGSTOP after completing step S (a hung rank: alive,
  silent, holding its peers in the next collective).

Kills and stops fire only in the first attempt of an elastic job (``TORCHELASTIC_RESTART_COUNT``
0 or unset) unless ``attempt=N`` says otherwise, so the restarted job runs clean. ``slow`` slows
every attempt, or only attempt N with ``attempt=N`` (a job paced until a failure, then at full
speed). With ``TORSH_FAULT_LOG=FILE`` every rank appends JSON lines (``kill``, ``resumed``,
``first_step``) with wall-clock times, from which tests and ``benchmarks/bench_checkpoint.py``
measure redone steps and recovery time. Nothing happens when the variable is unset.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

__all__ = [
    "Fault", "parse", "active", "on_step_end", "on_save_started", "on_replica_written", "log_event",
]

KINDS = ("kill", "kill-in-save", "kill-in-replication", "slow", "stop")


@dataclass(frozen=True, slots=True)
class Fault:
    """One parsed fault."""

    kind: str
    """``kill``, ``kill-in-save``, ``slow`` or ``stop``."""
    rank: int
    """The rank it hits."""
    step: int = -1
    """The step it fires at (kills)."""
    ms: float = 0.0
    """Milliseconds of sleep per step (``slow``)."""
    attempt: int | None = None
    """Elastic attempt (restart count) in which it fires; ``None``: attempt 0 for kills and
    stops, every attempt for ``slow``."""


def parse(spec: str) -> list[Fault]:
    """Parse a ``TORSH_FAULT`` value; ``ValueError`` names the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, *pairs = part.split(":")
        if kind not in KINDS:
            raise ValueError(f"TORSH_FAULT: unknown kind {kind!r} in {part!r}; use one of {KINDS}")
        values: dict[str, float] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in ("rank", "step", "ms", "attempt"):
                raise ValueError(f"TORSH_FAULT: bad field {pair!r} in {part!r}")
            values[key] = float(value)
        if "rank" not in values or (kind != "slow" and "step" not in values):
            raise ValueError(f"TORSH_FAULT: {part!r} needs rank= and (for kills) step=")
        faults.append(
            Fault(
                kind=kind,
                rank=int(values["rank"]),
                step=int(values.get("step", -1)),
                ms=values.get("ms", 0.0),
                attempt=int(values["attempt"]) if "attempt" in values else None,
            )
        )
    return faults


def active() -> list[Fault]:
    """The faults of this process's environment (empty when ``TORSH_FAULT`` is unset)."""
    return parse(os.environ.get("TORSH_FAULT", ""))


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def log_event(event: str, **fields: object) -> None:
    """Append one JSON line to ``TORSH_FAULT_LOG`` (if set)."""
    path = os.environ.get("TORSH_FAULT_LOG")
    if not path:
        return
    record = {"event": event, "t": time.time(), "attempt": _attempt(), **fields}
    with open(path, "a", encoding="utf-8") as fp:
        fp.write(json.dumps(record) + "\n")
        fp.flush()
        os.fsync(fp.fileno())


def _kill(rank: int, step: int, where: str) -> None:
    log_event("kill", rank=rank, step=step, where=where)
    os.kill(os.getpid(), signal.SIGKILL)


def _in_attempt(fault: Fault, default: int | None) -> bool:
    """Whether ``fault`` applies to this attempt (``default`` when it names none; ``None``: all)."""
    wanted = fault.attempt if fault.attempt is not None else default
    return wanted is None or wanted == _attempt()


def on_step_end(step: int, rank: int, faults: list[Fault]) -> None:
    """Apply ``slow``, ``kill`` and ``stop`` faults after ``step`` steps completed on ``rank``."""
    for fault in faults:
        if fault.rank != rank:
            continue
        if fault.kind == "slow":
            if _in_attempt(fault, None):
                time.sleep(fault.ms / 1000.0)
        elif fault.kind == "kill" and fault.step == step and _in_attempt(fault, 0):
            _kill(rank, step, "step")
        elif fault.kind == "stop" and fault.step == step and _in_attempt(fault, 0):
            log_event("stop", rank=rank, step=step)
            os.kill(os.getpid(), signal.SIGSTOP)


def on_save_started(step: int, rank: int, faults: list[Fault]) -> None:
    """Apply ``kill-in-save`` faults once the save of ``step`` has been started on ``rank``."""
    for fault in faults:
        if (
            fault.kind == "kill-in-save"
            and fault.rank == rank
            and fault.step == step
            and _in_attempt(fault, 0)
        ):
            _kill(rank, step, "save")


def on_replica_written(step: int, rank: int) -> None:
    """Apply ``kill-in-replication`` faults once ``rank`` wrote a file of a replica of ``step``."""
    for fault in active():
        if (
            fault.kind == "kill-in-replication"
            and fault.rank == rank
            and fault.step == step
            and _in_attempt(fault, 0)
        ):
            _kill(rank, step, "replication")
