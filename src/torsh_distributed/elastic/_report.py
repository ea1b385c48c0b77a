"""The one block a failed job prints: the root-cause rank, its traceback, the others in brief."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torsh_distributed.runtime.errors import is_peer_failure

__all__ = ["report_failure"]

# Exit signals the agent itself sends when it stops the rest of a failed group.
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGKILL, signal.SIGINT, signal.SIGHUP})


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


def report_failure(exc: ChildFailedError, *, node: int | None, log_dir: str | None, out: TextIO) -> int:
    """Print one block for a failed job; return the launcher's exit code.

    ``failures`` are this node's workers (each node's agent reports its own); ``node`` is this
    node's rank when the rendezvous fixed it, for workers that died without an error file.
    """
    failures = [_classify(rank, f) for rank, f in exc.failures.items()]
    root = _root_cause(failures)
    where = [f"local rank {root.failure.local_rank}"]
    group_rank = root.info.get("group_rank", node)
    if group_rank is not None:
        where.append(f"node {group_rank}")
    where.append(f"host {root.info.get('host') or socket.gethostname()}")
    lines = [f"torsh-dist: rank {root.rank} failed ({', '.join(where)}; {_status(root.failure)})"]
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
            first = (other.summary.splitlines() or [""])[0]
            if len(first) > 200:
                first = first[:197] + "..."
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
