"""What the launcher prints when workers fail.

A failed job: one block naming the root-cause rank, with its traceback, and the others in brief
(:func:`report_failure`). A failure that a restart follows: one line per failed rank and one for
the restart (:func:`report_restart`), at every verbosity, since no final report will show that
attempt."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torsh_distributed.runtime.errors import is_peer_failure

__all__ = ["report_failure", "report_restart"]

# Exit signals of workers the launcher stopped: the agent stops the rest of a failed group with
# SIGTERM; SIGINT and SIGHUP reach every worker when the launcher itself is interrupted. SIGKILL
# is not one of them (the agent sends it only to a worker that ignored SIGTERM for 30 s): it is
# how the OOM killer or `kill -9` ends a worker, a cause worth naming.
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


# --- the failure report ----------------------------------------------------------------------


@dataclass(slots=True)
class _Failure:
    rank: int
    failure: ProcessFailure
    info: dict[str, Any]
    summary: str
    traceback: str
    kind: str  # "primary", "secondary" (caused by a peer) or "stopped" (by the launcher)
    time_ns: int


def _classify(rank: int, failure: ProcessFailure) -> _Failure:
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    info = data.get("torsh") if isinstance(data.get("torsh"), dict) else {}
    message = failure.message
    traceback_text = ""
    if isinstance(message, dict):
        summary = str(message.get("message", ""))
        traceback_text = str(message.get("extraInfo", {}).get("py_callstack", ""))
    else:
        summary = ""
    summary = str(info.get("summary") or summary)
    has_record = bool(summary)
    signum = -failure.exitcode if failure.exitcode < 0 else None
    if has_record:
        kind = "secondary" if is_peer_failure(summary) else "primary"
    elif signum is not None and signum in {int(s) for s in _STOP_SIGNALS}:
        kind = "stopped"
    else:
        kind = "primary"  # a crash (SIGSEGV, SIGABRT) or an exit code without an exception
    if not has_record:
        if signum is not None:
            summary = f"killed by {failure.signal_name()}"
        else:
            summary = f"exited with code {failure.exitcode} without raising (sys.exit or os._exit)"
    time_ns = int(info.get("time_ns") or failure.timestamp * 1_000_000_000)
    return _Failure(rank, failure, info, summary, traceback_text, kind, time_ns)


def _root_cause(failures: Iterable[_Failure]) -> _Failure:
    order = {"primary": 0, "secondary": 1, "stopped": 2}
    return min(failures, key=lambda f: (order[f.kind], f.time_ns, f.rank))


def _exit_code(failure: _Failure) -> int:
    code = failure.failure.exitcode
    return code if code > 0 else 128 - code


def _status(failure: ProcessFailure) -> str:
    code = failure.exitcode
    return f"exit code {code}" if code >= 0 else f"killed by {failure.signal_name()}"


def _where(failure: _Failure, node: int | None) -> str:
    """``local rank L, node N, host H`` (the node when known: the worker's record, or ``node``)."""
    where = [f"local rank {failure.failure.local_rank}"]
    group_rank = failure.info.get("group_rank", node)
    if group_rank is not None:
        where.append(f"node {group_rank}")
    where.append(f"host {failure.info.get('host') or socket.gethostname()}")
    return ", ".join(where)


def _first_line(text: str) -> str:
    first = (text.splitlines() or [""])[0]
    return first[:197] + "..." if len(first) > 200 else first


def report_restart(
    failures: Mapping[int, ProcessFailure],
    *,
    restart: int,
    max_restarts: int,
    node: int | None,
    num_workers: int,
    out: TextIO,
) -> None:
    """One line per failed rank (the root cause first), then one for the restart that follows.

    ``failures`` maps global ranks to this node's failed workers, as the agent saw them when it
    decided to restart; ``restart`` counts from 1 up to ``max_restarts``. Workers the agent
    stopped (SIGTERM) because of the failure are not failures and are not listed.
    """
    classified = [_classify(rank, f) for rank, f in failures.items()]
    lines = []
    if classified:
        root = _root_cause(classified)
        # ranks the agent stopped (SIGTERM) because of the root cause are not failures
        others = sorted(
            (f for f in classified if f is not root and f.kind != "stopped"),
            key=lambda f: f.rank,
        )
        for failure in [root, *others]:
            status = _status(failure.failure)
            # a signal says it all; an exit code needs the exception (its traceback is not shown)
            detail = "" if status.startswith("killed by") else f": {_first_line(failure.summary)}"
            lines.append(
                f"torsh-dist: rank {failure.rank} failed ({_where(failure, node)}; {status}){detail}"
            )
    else:  # UNHEALTHY without a failed process (the agent's own health check)
        lines.append(f"torsh-dist: the workers of node {node if node is not None else '?'} are unhealthy")
    lines.append(
        f"torsh-dist: restart {restart} of {max_restarts} (--max-restarts {max_restarts}): "
        f"all {num_workers} worker(s) of this node start again"
    )
    print("\n".join(lines), file=out, flush=True)


def report_failure(exc: ChildFailedError, *, node: int | None, log_dir: str | None, out: TextIO) -> int:
    """Print one block for a failed job; return the launcher's exit code.

    ``failures`` are this node's workers (each node's agent reports its own); ``node`` is this
    node's rank when the rendezvous fixed it, for workers that died without an error file.
    """
    failures = [_classify(rank, f) for rank, f in exc.failures.items()]
    root = _root_cause(failures)
    lines = [f"torsh-dist: rank {root.rank} failed ({_where(root, node)}; {_status(root.failure)})"]
    if root.traceback:
        lines.append(root.traceback.rstrip("\n"))
    else:
        lines.append(f"no Python traceback: {root.summary}; see the rank's output above")
    others = sorted(
        (f for f in failures if f is not root and f.kind != "stopped"), key=lambda f: f.rank
    )
    if others:
        lines.append("other failed ranks:")
        for other in others:
            first = _first_line(other.summary)
            lines.append(
                f"  rank {other.rank} (local rank {other.failure.local_rank}): {first} "
                f"({_status(other.failure)})"
            )
    stopped = sorted(f.rank for f in failures if f is not root and f.kind == "stopped")
    if stopped:
        lines.append(
            f"stopped by the launcher after the failure: ranks {', '.join(map(str, stopped))}"
        )
    if log_dir is not None:
        error_file = root.failure.error_file
        attempt_dir = (
            os.path.dirname(os.path.dirname(error_file)) if os.path.isfile(error_file) else ""
        )
        lines.append(f"worker logs: {os.path.abspath(attempt_dir or log_dir)}")
    print("\n".join(lines), file=out, flush=True)

    primaries = [f for f in failures if f.kind == "primary"]
    if len(primaries) == 1:
        return _exit_code(primaries[0])
    if not primaries and len(failures) == 1:
        return _exit_code(failures[0])
    return 1
