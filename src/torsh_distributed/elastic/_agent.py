"""torch's local elastic agent, made to say when it restarts the workers and why.

torch's agent restarts a failed worker group silently (its own log line is at INFO, hidden unless
``--verbose``, and names neither the rank nor the signal). :class:`_ReportingAgent` is torch's
``LocalElasticAgent`` with two additions:

* when ``_monitor_workers`` (the hook the agent's implementations provide) finds failed workers
  and a restart is left, it prints which ranks failed and the restart number
  (:func:`~torsh_distributed.elastic._report.report_restart`);
* when it stops the workers (a signal to the launcher, or a restart), workers started as a
  function (the warm forkserver path) that have already returned exit at once. torch's
  ``MultiprocessContext`` keeps such a worker waiting for an event that only its polling loop
  sets, and its ``close`` does not: each stop waited the whole 30 s shutdown timeout and then
  SIGKILLed workers that had finished cleanly (a 2-rank `torsh-dist serve` took 31 s to stop
  after SIGTERM).

Everything else, including the decision to restart, stays torch's.

``launch_agent`` builds its agent from the module-level name ``LocalElasticAgent`` of
``torch.distributed.launcher.api``; :func:`reporting_agent` points that name at the subclass for
the duration of one launch, which keeps ``launch_agent`` itself (rendezvous parameters, metrics,
events, shutdown) torch's across versions.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any, TextIO

import torch.distributed.launcher.api as _launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from torsh_distributed.elastic._report import report_restart

__all__ = ["reporting_agent"]

_LOCK = threading.Lock()
_local = threading.local()  # the agent runs in the thread that called launch(): its `out`
_patch: dict[str, Any] = {"users": 0, "saved": None}


class _ReportingAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that reports each failure a restart follows (see module docstring)."""

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        remaining = getattr(self, "_remaining_restarts", None)
        failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        if failed:
            _add_other_failures(self._pcontext, worker_group, result)
        out: TextIO | None = getattr(_local, "out", None)
        if failed and out is not None and isinstance(remaining, int) and remaining > 0:
            spec = worker_group.spec
            report_restart(
                result.failures,
                restart=spec.max_restarts - remaining + 1,
                max_restarts=spec.max_restarts,
                node=worker_group.group_rank,
                num_workers=len(worker_group.workers),
                out=out,
            )
        return result

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        _release_returned_workers(self._pcontext)
        super()._shutdown(*args, **kwargs)


def _release_returned_workers(pcontext: Any) -> None:
    """Let function workers exit once they return (see the module docstring); workers still
    running are not affected (they look at the event only after their function returns).

    torch's own warning: setting the event deadlocks when a worker died while waiting on it
    (the condition waits for every sleeper to wake). A worker that returned (its value queued)
    and is gone died waiting (torch stops the others when one fails): then the event is left
    alone. The set runs in a daemon thread, joined briefly, so no other case can hang a stop."""
    finished = getattr(pcontext, "_worker_finished_event", None)
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
    queues = getattr(pcontext, "_ret_vals", None)
    if finished is None or processes is None or queues is None:
        return  # spawned workers (a command line): nothing waits
    for local_rank, proc in enumerate(processes):
        if not proc.is_alive() and not queues[local_rank].empty():
            return
    setter = threading.Thread(target=finished.set, name="torsh-release-workers", daemon=True)
    setter.start()
    setter.join(1.0)


def _add_other_failures(pcontext: Any, worker_group: WorkerGroup, result: RunResult) -> None:
    """Warm-started workers (a function entry point, torch's ``MultiprocessContext``): torch
    reports only the first failed worker it notices, then stops the rest. Add every other worker
    that did not exit cleanly, with its error file, as a spawned worker group reports them, so
    the launcher's report can tell the rank that failed first from its victims."""
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if not processes:
        return  # spawned workers: torch already lists every failure
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for local_rank, proc in enumerate(processes):
        rank = worker_group.workers[local_rank].global_rank
        if rank in result.failures or proc.exitcode in (0, None):
            continue
        error_file = pcontext.error_files[local_rank]
        try:  # a worker stopped while it wrote its record: no record (torch would fail on it)
            with open(error_file, encoding="utf-8") as fp:
                json.load(fp)
        except (OSError, ValueError):
            error_file = ""
        result.failures[rank] = ProcessFailure(
            local_rank=local_rank, pid=proc.pid, exitcode=proc.exitcode, error_file=error_file
        )


@contextlib.contextmanager
def reporting_agent(out: TextIO) -> Iterator[None]:
    """Within the block, ``launch_agent`` in this thread runs :class:`_ReportingAgent`, printing
    to ``out``. Concurrent launches in other threads get the same class, each its own ``out``."""
    previous = getattr(_local, "out", None)
    with _LOCK:
        if _patch["users"] == 0:
            _patch["saved"] = _launcher_api.LocalElasticAgent
            _launcher_api.LocalElasticAgent = _ReportingAgent  # type: ignore[misc]
        _patch["users"] += 1
    _local.out = out
    try:
        yield
    finally:
        _local.out = previous
        with _LOCK:
            _patch["users"] -= 1
            if _patch["users"] == 0:
                _launcher_api.LocalElasticAgent = _patch["saved"]  # type: ignore[misc]
