"""Dask side of :func:`torsh_distributed.launch.dask`: one task per rank, pinned to a worker.

Each rank's task is restricted to one worker (``workers=[address]``,
``allow_other_workers=False``), so two ranks never share a process (torch.distributed has one
default group per process). Dask itself would resubmit the task of a dead worker elsewhere or
leave it waiting for that worker forever; the supervisor instead watches the scheduler's worker
list and reports the rank whose worker vanished. Ranks still running when the job fails are
stopped by ending their worker processes, which their nannies replace (a thread blocked in a
collective cannot be cancelled), so no rank lingers in a worker of a long-lived cluster. Every
task of a job runs with the worker's statistical profiler paused (:func:`without_profiler`: on
CPython 3.11 it can freeze a worker for good).
"""

from __future__ import annotations

import logging
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torsh_distributed.launch import _workers
from torsh_distributed.launch._workers import JobSpec, Placement, RankOutcome
from torsh_distributed.runtime.errors import DistributedTimeoutError, ProcessFailureError

__all__ = ["DaskOptions", "import_distributed", "pick_workers", "run", "without_profiler"]

log = logging.getLogger(__name__)

_LIVENESS_EVERY_S = 0.5  # how often the scheduler is asked which workers exist
_GONE_WITHIN_S = 10.0  # how long a killed worker may take to leave the scheduler's list


@dataclass(frozen=True, kw_only=True, slots=True)
class DaskOptions:
    """Which Dask cluster runs the job (validated at construction)."""

    client: Any = None
    """A connected ``distributed.Client`` (left open at the end), or ``None``."""
    address: str | None = None
    """A scheduler address (``"tcp://host:8786"``) to connect to, or ``None``. With neither,
    a ``LocalCluster`` of ``num_workers`` single-threaded worker processes on ``127.0.0.1`` is
    started and closed at the end."""

    def __post_init__(self) -> None:
        if self.client is not None and self.address is not None:
            raise ValueError("pass client or address, not both")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ValueError(f"address must be a non-empty str or None, got {self.address!r}")
        if self.client is not None and not callable(getattr(self.client, "submit", None)):
            raise TypeError(
                f"client must be a distributed.Client, got {type(self.client).__name__}"
            )


def import_distributed() -> Any:
    """The ``distributed`` module, or an ``ImportError`` that says how to install it."""
    try:
        import distributed
    except ImportError as exc:
        raise ImportError(
            "torsh_distributed.launch.dask needs Dask's distributed scheduler, which is not "
            "installed: pip install 'torsh-distributed[dask]'"
        ) from exc
    return distributed


def run(spec: JobSpec, options: DaskOptions) -> list[Any]:
    """Run ``spec`` on Dask as :func:`torsh_distributed.launch.dask` documents."""
    distributed = import_distributed()
    cluster = None
    client = options.client
    owned_client = client is None
    if client is None:
        if options.address is None:
            cluster = distributed.LocalCluster(
                n_workers=spec.num_workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
        client = distributed.Client(cluster or options.address, timeout=spec.timeout_s)
    job = _Job(distributed, client, spec, stop_ranks=cluster is None)
    try:
        return job.run()
    finally:  # each step even if one fails; the job's own error matters more
        try:
            job.stop()
        except Exception as exc:  # noqa: BLE001
            log.warning("launch.dask: stopping the job's ranks failed: %s", exc)
        finally:
            if owned_client:
                client.close()
            if cluster is not None:
                cluster.close()


class _Job:
    def __init__(self, distributed: Any, client: Any, spec: JobSpec, *, stop_ranks: bool) -> None:
        self.distributed, self.client, self.spec = distributed, client, spec
        self.stop_ranks = stop_ranks  # end workers still running a rank (not our cluster)
        self.job_id = uuid.uuid4().hex
        self.addresses: list[str] = []  # worker of each rank
        self.futures: dict[Any, int] = {}  # rank's future -> rank
        self.store_worker: str | None = None

    def _workers(self) -> dict[str, dict[str, Any]]:
        """The scheduler's workers, asked now. Not ``client.scheduler_info()``: when its query
        fails (an ``OSError``: a timed-out or closed comm on a busy host) it returns the
        client's cached copy without a word, and the client's periodic refresh caches *no*
        workers (``n_workers=0``): every rank then looked dead at once (ci61)."""
        identity = self.client.sync(self.client.scheduler.identity, n_workers=-1)
        return dict(identity["workers"])

    def _submit(self, func: Any, *args: Any, worker: str, key: str) -> Any:
        return self.client.submit(
            without_profiler,
            func,
            *args,
            workers=[worker],
            allow_other_workers=False,
            pure=False,
            key=key,
        )

    def run(self) -> list[Any]:
        spec = self.spec
        deadline = time.monotonic() + spec.start_s  # until every rank is ready to rendezvous
        try:
            self.client.wait_for_workers(spec.num_workers, timeout=spec.start_s)
        except TimeoutError as exc:
            raise DistributedTimeoutError(
                f"the Dask cluster did not have {spec.num_workers} worker(s) within "
                f"{spec.start_s:g} s (it has {len(self._workers())})",
                operation="launch.dask",
                fix="start more workers, lower num_workers, or raise start_timeout_s.",
            ) from exc
        chosen = pick_workers(self._workers(), spec.num_workers)
        while len(chosen) < spec.num_workers and time.monotonic() < deadline:
            time.sleep(0.1)  # one left "running" since wait_for_workers (e.g. it is closing)
            chosen = pick_workers(self._workers(), spec.num_workers)
        if len(chosen) < spec.num_workers:
            raise DistributedTimeoutError(
                f"the Dask cluster did not have {spec.num_workers} running worker(s) within "
                f"{spec.start_s:g} s",
                operation="launch.dask",
                fix="start more workers, lower num_workers, or raise start_timeout_s.",
            )
        # One copy of the spec per worker; unpickling it there imports fn's module up front.
        [spec_future] = self.client.scatter(
            [spec], workers=[a for a, _ in chosen], broadcast=True, hash=False
        )
        prepared = [
            self._submit(
                _workers.prepare, spec_future, worker=address, key=f"torsh-prepare{i}-{self.job_id}"
            )
            for i, (address, _) in enumerate(chosen)
        ]
        described = self._results(prepared, deadline, "start")
        order, placements = _workers.assign_ranks([info["host"] for _, info in chosen])
        self.addresses = [chosen[i][0] for i in order]
        wheres = [
            f"Dask worker {chosen[i][0]}, pid {described[i][1]} on {described[i][0]}" for i in order
        ]
        self.store_worker = self.addresses[0]
        [port] = self._results(
            [
                self._submit(
                    _workers.open_store,
                    self.job_id,
                    placements[0].master_addr,
                    spec.num_workers,
                    spec.timeout_s,
                    worker=self.store_worker,
                    key=f"torsh-store-{self.job_id}",
                )
            ],
            deadline,
            "open the rendezvous store on rank 0",
        )
        for p in placements:
            rank_future = self._submit(
                _workers.run_rank,
                self.job_id,
                _with_port(p, port),
                spec_future,
                wheres[p.rank],
                worker=self.addresses[p.rank],
                key=f"torsh-rank{p.rank}-{self.job_id}",
            )
            self.futures[rank_future] = p.rank
        return _workers.supervise(
            self._poll_fn(wheres), world_size=spec.num_workers, launcher="dask"
        )

    def _results(self, futures: list[Any], deadline: float, what: str) -> list[Any]:
        try:
            self.distributed.wait(futures, timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            self.client.cancel(futures, force=True)
            raise DistributedTimeoutError(
                f"Dask workers did not {what} within start_timeout_s (busy with other tasks?)",
                operation="launch.dask",
                fix="give the job idle workers, or raise start_timeout_s.",
            ) from None
        try:
            return list(self.client.gather(futures))
        except Exception as exc:  # noqa: BLE001 - e.g. fn's module is not importable there
            raise ProcessFailureError(
                f"Dask workers failed to {what}: {type(exc).__name__}: {exc}",
                operation="launch.dask",
                fix="fn, its module and its arguments must be importable on the workers.",
            ) from exc

    def _poll_fn(self, wheres: list[str]) -> Callable[[float], Iterable[RankOutcome]]:
        pending = dict(self.futures)
        last_check = time.monotonic()

        def poll(timeout: float) -> Iterable[RankOutcome]:
            nonlocal last_check
            if not pending:
                return []
            try:
                self.distributed.wait(list(pending), timeout=timeout, return_when="FIRST_COMPLETED")
            except TimeoutError:
                pass
            outcomes = []
            for future in [f for f in pending if f.done()]:
                rank = pending.pop(future)
                outcomes.append(_outcome(future, rank, wheres[rank]))
            if pending and time.monotonic() - last_check >= _LIVENESS_EVERY_S:
                last_check = time.monotonic()
                try:
                    alive = self._workers()
                except OSError as exc:  # the scheduler did not answer: ask again next time
                    log.debug("launch.dask: the scheduler's worker list failed: %s", exc)
                    return outcomes
                for future, rank in list(pending.items()):
                    if self.addresses[rank] not in alive:  # the process died (a nanny restart
                        pending.pop(future)  # comes back under a new address)
                        outcomes.append(
                            RankOutcome(
                                rank=rank,
                                ok=False,
                                died=True,
                                error=f"worker {self.addresses[rank]} left the cluster",
                                where=wheres[rank],
                            )
                        )
            return outcomes

        return poll

    def stop(self) -> None:
        """Cancel what is still pending and stop ranks still running (on a cluster we keep)."""
        unfinished = [f for f in self.futures if not f.done()]
        if unfinished:
            self.client.cancel(unfinished, force=True)
        if self.store_worker is not None and self.stop_ranks and (unfinished or not self.futures):
            self.client.run(  # rank 0 may never have taken its store
                _workers.close_store, self.job_id, workers=[self.store_worker], on_error="ignore"
            )
        if not unfinished or not self.stop_ranks:
            return  # a cluster this call started is closed right after
        alive = self._workers()
        busy = [self.addresses[self.futures[f]] for f in unfinished]
        busy = [address for address in busy if address in alive]
        without_nanny = [a for a in busy if not alive[a].get("nanny")]
        if without_nanny:
            warnings.warn(
                f"Dask worker(s) {', '.join(without_nanny)} have no nanny and are left running: "
                "their rank stops at its next collective, after timeout_s",
                stacklevel=2,
            )
        doomed = [a for a in busy if a not in without_nanny]
        if not doomed:
            return
        # A graceful restart waits for the blocked task thread first; killing the process
        # (its nanny starts a fresh worker) frees the worker at once.
        self.client.run(_workers.exit_process, workers=doomed, wait=False, on_error="ignore")
        deadline = time.monotonic() + _GONE_WITHIN_S
        while time.monotonic() < deadline and set(doomed) & set(self._workers()):
            time.sleep(0.1)  # the next job must not pick a worker that is about to vanish


_PROFILER = ("profile", "profile-cycle")  # the worker's periodic callbacks that sample stacks


def without_profiler(func: Callable[..., Any], *args: Any) -> Any:
    """Run ``func(*args)`` on a Dask worker with the worker's statistical profiler paused.

    Every 10 ms the profiler calls ``sys._current_frames()`` on the worker's event loop. On
    CPython 3.11 that call can run the garbage collector while holding the runtime's lock, and
    a finalizer that needs the same lock then freezes the whole process with the GIL held
    (CPython gh-106883/gh-116969, dask/distributed#8616): seen here as a rank stuck in a
    forward pass while its peer waited in an all-reduce, a process alive (the peer's dead-peer
    check cannot fire), still listed by the scheduler, and deaf to the launcher's stop. A rank
    allocates all the time, which makes it likely. The callbacks are restored afterwards.
    """
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):  # not inside a Dask worker (tests call it directly)
        return func(*args)
    callbacks = [worker.periodic_callbacks.get(name) for name in _PROFILER]
    paused = [pc for pc in callbacks if pc is not None and pc.is_running()]
    _on_loop(worker, [pc.stop for pc in paused])
    try:
        return func(*args)
    finally:
        _on_loop(worker, [pc.start for pc in paused])


def _on_loop(worker: Any, calls: list[Callable[[], None]]) -> None:
    """Run ``calls`` on the worker's event loop (tornado callbacks are not thread-safe); wait
    until they ran, up to 5 s."""
    if not calls:
        return
    import threading

    done = threading.Event()

    def run() -> None:
        try:
            for call in calls:
                call()
        finally:
            done.set()

    worker.loop.add_callback(run)
    done.wait(5.0)


def pick_workers(workers: dict[str, dict[str, Any]], num: int) -> list[tuple[str, dict[str, Any]]]:
    """The ``num`` workers a job takes, from the scheduler's worker list: only those in status
    ``running`` (the ones ``wait_for_workers`` counts; the list also holds workers still
    starting, paused, or closing, which the scheduler refuses to scatter to: "No valid workers
    found"), idle ones first (a long-lived cluster may be busy elsewhere), then by host."""
    running = [kv for kv in workers.items() if kv[1].get("status", "running") == "running"]
    return sorted(
        running,
        key=lambda kv: (bool(kv[1].get("metrics", {}).get("task_counts")), kv[1]["host"], kv[0]),
    )[:num]


def _with_port(placement: Placement, port: int) -> Placement:
    import dataclasses

    return dataclasses.replace(placement, master_port=port)


def _outcome(future: Any, rank: int, where: str) -> RankOutcome:
    if future.status == "finished":
        try:
            outcome = future.result()
        except Exception as exc:  # noqa: BLE001 - e.g. a result that would not unpickle
            return RankOutcome(
                rank=rank, ok=False, error=f"{type(exc).__name__}: {exc}", where=where
            )
        assert isinstance(outcome, RankOutcome), type(outcome)
        return outcome
    if future.status == "cancelled":
        return RankOutcome(
            rank=rank, ok=False, error="CancelledError: the task was cancelled", where=where
        )
    exc = future.exception()
    died = type(exc).__name__ == "KilledWorker"
    return RankOutcome(
        rank=rank, ok=False, died=died, error=f"{type(exc).__name__}: {exc}", where=where
    )
