"""The Ray and Dask launchers without a cluster: argument checks, missing packages, rank layout,
the supervisor's root-cause choice, and one rank's lifecycle in this process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torsh_distributed import launch
from torsh_distributed.launch import _teardown, _workers
from torsh_distributed.launch._workers import JobSpec, RankOutcome
from torsh_distributed.runtime.errors import DistributedTimeoutError, ProcessFailureError


def _noop() -> None:
    return None


pytestmark = pytest.mark.timeout(60)

LAUNCHERS = [launch.ray, launch.dask]


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": 0}, ValueError, r"num_workers must be >= 1, got 0"),
        ({"num_workers": True}, TypeError, r"num_workers must be an int"),
        ({"num_workers": 2.0}, TypeError, r"num_workers must be an int"),
        ({"num_workers": 2, "timeout_s": 0}, ValueError, r"timeout_s must be a positive"),
        (
            {"num_workers": 2, "timeout_s": float("inf")},
            ValueError,
            r"timeout_s must be a positive",
        ),
        ({"num_workers": 2, "timeout_s": "60"}, TypeError, r"timeout_s must be a number"),
        (
            {"num_workers": 2, "start_timeout_s": -1},
            ValueError,
            r"start_timeout_s must be a positive",
        ),
        ({"num_workers": 2, "args": 3}, TypeError, r"args must be a tuple or list"),
        (
            {"num_workers": 2, "kwargs": {1: 2}},
            TypeError,
            r"kwargs must be a mapping with str keys",
        ),
        ({"num_workers": 2, "env": {"RANK": "3"}}, ValueError, r"env must not set RANK"),
        ({"num_workers": 2, "env": {"X": 1}}, TypeError, r"env must be a mapping of str to str"),
        (
            {"num_workers": 2, "backend": "mpi"},
            ValueError,
            r"backend must be one of auto, gloo, nccl",
        ),
    ],
)
def test_bad_arguments_fail_before_anything_starts(
    launcher: Callable[..., Any], kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        launcher(_noop, **kwargs)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_fn_must_be_callable(launcher: Callable[..., Any]) -> None:
    with pytest.raises(TypeError, match=r"fn must be callable, got str"):
        launcher("train", num_workers=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"resources_per_worker": {}}, r"resources_per_worker must be a non-empty mapping"),
        ({"resources_per_worker": {"CPU": -1}}, r"resources_per_worker\['CPU'\] must be >= 0"),
        ({"resources_per_worker": {"CPU": 0}}, r"resources_per_worker must ask for something"),
        ({"resources_per_worker": {"CPU": "1"}}, r"must map str to numbers"),
        ({"placement_strategy": "TIGHT"}, r"placement_strategy must be one of PACK, SPREAD"),
        ({"address": ""}, r"address must be a non-empty str or None"),
    ],
)
def test_ray_options_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        launch.ray(_noop, num_workers=2, **kwargs)


def test_dask_client_xor_address() -> None:
    with pytest.raises(ValueError, match=r"pass client or address, not both"):
        launch.dask(_noop, num_workers=2, client=object(), address="tcp://h:8786")
    with pytest.raises(TypeError, match=r"client must be a distributed.Client, got str"):
        launch.dask(_noop, num_workers=2, client="tcp://h:8786")


@pytest.mark.parametrize(
    ("launcher", "module", "extra"),
    [(launch.ray, "ray", "ray"), (launch.dask, "distributed", "dask")],
)
def test_missing_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, launcher: Callable[..., Any], module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ImportError, match=rf"pip install 'torsh-distributed\[{extra}\]'"):
        launcher(_noop, num_workers=2)
    with pytest.raises(ValueError, match="num_workers"):  # arguments are checked first
        launcher(_noop, num_workers=0)


def test_assign_ranks_one_node_uses_loopback() -> None:
    order, placements = _workers.assign_ranks(["10.0.0.5", "10.0.0.5", "10.0.0.5"])
    assert order == [0, 1, 2]
    assert {p.master_addr for p in placements} == {"127.0.0.1"}
    assert {p.bind_addr for p in placements} == {"127.0.0.1"}
    assert [p.local_rank for p in placements] == [0, 1, 2]
    assert {(p.local_world_size, p.node_rank, p.world_size) for p in placements} == {(3, 0, 3)}


def test_assign_ranks_groups_nodes_contiguously() -> None:
    order, placements = _workers.assign_ranks(["a", "b", "a", "b", "b"])
    assert order == [0, 2, 1, 3, 4]  # node a's workers first, then node b's
    assert [p.node_rank for p in placements] == [0, 0, 1, 1, 1]
    assert [p.local_rank for p in placements] == [0, 1, 0, 1, 2]
    assert [p.local_world_size for p in placements] == [2, 2, 3, 3, 3]
    assert {p.master_addr for p in placements} == {"a"}  # rank 0's node
    assert [p.bind_addr for p in placements] == ["a", "a", "b", "b", "b"]


def _scripted(
    batches: list[list[RankOutcome]],
) -> tuple[Callable[[float], Iterable[RankOutcome]], list[int]]:
    calls: list[int] = []

    def poll(timeout: float) -> Iterable[RankOutcome]:
        calls.append(1)
        return batches.pop(0) if batches else []

    return poll, calls


def test_dask_picks_only_running_workers_idle_first() -> None:
    from torsh_distributed.launch._dask_backend import pick_workers

    def worker(status: str, busy: bool) -> dict[str, Any]:
        return {
            "status": status,
            "host": "127.0.0.1",
            "metrics": {"task_counts": {"x": 1}} if busy else {},
        }

    workers = {
        "tcp://a:1": worker("running", busy=True),  # ran an earlier job's rank
        "tcp://b:1": worker("closing", busy=False),  # a stopped rank's worker on its way out
        "tcp://c:1": worker("init", busy=False),  # its replacement, registered but not running
        "tcp://d:1": worker("running", busy=False),
    }
    # wait_for_workers counts 2 running; the scheduler scatters only to running workers
    assert [a for a, _ in pick_workers(workers, 2)] == ["tcp://d:1", "tcp://a:1"]
    assert [a for a, _ in pick_workers(workers, 3)] == ["tcp://d:1", "tcp://a:1"]


def test_supervise_returns_values_in_rank_order() -> None:
    poll, _ = _scripted(
        [[RankOutcome(rank=1, ok=True, value="b")], [RankOutcome(rank=0, ok=True, value="a")]]
    )
    assert _workers.supervise(poll, world_size=2, launcher="test") == ["a", "b"]


def test_a_dead_worker_is_the_root_cause_over_the_peer_that_saw_it() -> None:
    victim = RankOutcome(
        rank=0, ok=False, error="DistBackendError: Connection closed by peer [::1]:5"
    )
    dead = RankOutcome(rank=1, ok=False, died=True, error="ActorDiedError: gone", where="actor 7")
    poll, _ = _scripted([[victim], [], [dead]])
    with pytest.raises(ProcessFailureError, match=r"rank 1 of 2 died \(actor 7\)") as info:
        _workers.supervise(poll, world_size=2, launcher="test", interval_s=0.01)
    assert info.value.rank == 1 and info.value.operation == "launch.test"
    assert "rank 0 (): DistBackendError: Connection closed by peer" in str(info.value)
    assert "a consequence of the failure above" in str(info.value)


def test_own_error_stops_waiting_at_once_and_keeps_the_exception() -> None:
    cause = KeyError("shard")
    failed = RankOutcome(
        rank=2, ok=False, error="KeyError: 'shard'", traceback="Traceback...", exception=cause
    )
    poll, calls = _scripted([[failed]])
    with pytest.raises(ProcessFailureError, match=r"rank 2 of 3 failed") as info:
        _workers.supervise(poll, world_size=3, launcher="test", grace_s=60)
    assert len(calls) == 1  # no grace: ranks 0 and 1 can only fail after rank 2
    assert info.value.__cause__ is cause
    assert "rank(s) 0, 1 had not finished and were stopped" in str(info.value)


def test_a_timeout_waits_the_grace_then_raises_a_timeout_error() -> None:
    timed_out = RankOutcome(
        rank=0, ok=False, error="RuntimeError: Timed out waiting 4000ms for recv"
    )
    poll, calls = _scripted([[timed_out]])
    with pytest.raises(DistributedTimeoutError, match=r"rank 0 of 2 timed out") as info:
        _workers.supervise(poll, world_size=2, launcher="test", interval_s=0.01, grace_s=0.1)
    assert len(calls) > 1  # waited for rank 1's news during the grace
    assert "a rank that hangs makes its peers time out" in str(info.value)


def _sum_with_env(offset: float) -> tuple[float, str | None, str | None]:
    tensor = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(tensor)
    return tensor.item(), os.environ.get("MASTER_ADDR"), os.environ.get("TORSH_UNIT_MARK")


def _raise_value_error() -> None:
    raise ValueError("no data for this rank")


def test_run_rank_in_this_process_sets_and_restores_everything() -> None:
    spec = JobSpec(
        fn=_sum_with_env, num_workers=1, args=(2.5,), timeout_s=30, env={"TORSH_UNIT_MARK": "m"}
    )
    [placement] = _workers.assign_ranks(["node"])[1]
    assert _workers.prepare(spec)[1] == os.getpid()
    port = _workers.open_store("job-a", placement.master_addr, 1, spec.timeout_s)
    before = dict(os.environ)
    outcome = _workers.run_rank("job-a", _replace_port(placement, port), spec, "here")
    assert outcome.ok, outcome.traceback
    assert outcome.value == (2.5, "127.0.0.1", "m")
    assert dict(os.environ) == before  # layout and env variables restored
    assert not dist.is_initialized()  # the group is destroyed
    assert not _workers.close_store("job-a")  # rank 0 took its store


def test_run_rank_reports_an_error_instead_of_raising() -> None:
    spec = JobSpec(fn=_raise_value_error, num_workers=1, timeout_s=30)
    [placement] = _workers.assign_ranks(["node"])[1]
    port = _workers.open_store("job-b", placement.master_addr, 1, spec.timeout_s)
    outcome = _workers.run_rank("job-b", _replace_port(placement, port), spec, "here")
    assert not outcome.ok and outcome.severity == 1
    assert outcome.error == "ValueError: no data for this rank"
    assert "_raise_value_error" in outcome.traceback
    assert isinstance(outcome.exception, ValueError)
    assert not dist.is_initialized()


def test_a_failed_rank_reports_before_a_slow_teardown_which_the_next_call_awaits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    import time

    release = threading.Event()
    destroy = _teardown._destroy_group

    def slow_destroy() -> None:  # a teardown that blocks, as one stuck behind a hung peer
        if dist.is_initialized():
            release.wait(60)
        destroy()

    spec = JobSpec(fn=_raise_value_error, num_workers=1, timeout_s=30, start_timeout_s=0.5)
    [placement] = _workers.assign_ranks(["node"])[1]
    port = _workers.open_store("job-c", placement.master_addr, 1, spec.timeout_s)
    monkeypatch.setattr(_teardown, "_destroy_group", slow_destroy)
    try:
        start = time.monotonic()
        outcome = _workers.run_rank(
            "job-c", _replace_port(placement, port), spec, "here", cleanup_wait_s=0.2
        )
        assert time.monotonic() - start < 30  # not after the teardown (released below, never)
        assert outcome.error == "ValueError: no data for this rank"
        assert outcome.cleanup_s is None and outcome.finished_at is not None
        assert dist.is_initialized()  # the teardown is still going on
        # a next call in this process waits for it, says so when it does not end in time, and
        # does not start a second teardown beside the stuck one
        again = _workers.run_rank(
            "job-d", _replace_port(placement, port), spec, "here", cleanup_wait_s=0.2
        )
        assert not again.ok and "still being torn down after 0.5 s" in again.error
        assert again.cleanup_s is None and len(_teardown._CLEANUP) == 1
        assert not _workers.finish_cleanup(0.1)
    finally:
        release.set()
        assert _workers.finish_cleanup(30)
    assert not dist.is_initialized() and not _teardown._CLEANUP
    port = _workers.open_store("job-e", placement.master_addr, 1, spec.timeout_s)
    ok = JobSpec(fn=_sum_with_env, num_workers=1, args=(1.0,), timeout_s=30)
    third = _workers.run_rank("job-e", _replace_port(placement, port), ok, "here")
    assert third.ok and third.value[0] == 1.0, third.traceback
    assert third.cleanup_s is not None


def test_by_default_a_failed_rank_tears_down_before_it_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dask's workers outlive the task: the next job must find the process clean."""
    torn: list[bool] = []
    destroy = _teardown._destroy_group

    def recorded() -> None:
        if dist.is_initialized():
            torn.append(True)
        destroy()

    monkeypatch.setattr(_teardown, "_destroy_group", recorded)
    spec = JobSpec(fn=_raise_value_error, num_workers=1, timeout_s=30)
    [placement] = _workers.assign_ranks(["node"])[1]
    port = _workers.open_store("job-f", placement.master_addr, 1, spec.timeout_s)
    outcome = _workers.run_rank("job-f", _replace_port(placement, port), spec, "here")
    assert not outcome.ok and torn == [True] and outcome.cleanup_s is not None
    assert not dist.is_initialized()


def _replace_port(placement: _workers.Placement, port: int) -> _workers.Placement:
    import dataclasses

    return dataclasses.replace(placement, master_port=port)


@pytest.mark.parametrize(
    ("error", "exception", "severity"),
    [
        ("DistBackendError: Timed out waiting 4000ms for recv operation", None, 2),
        ("DistStoreError: wait timeout after 30000ms, keys: /default_pg/0//cpu//0", None, 2),
        ("DistributedTimeoutError: [rank 1] peers did not join", DistributedTimeoutError("x"), 2),
        ("ValueError: timeout_s of the user's own config is wrong", None, 1),  # not torch's
        ("RuntimeError: Connection closed by peer [127.0.0.1]:4031", None, 3),
    ],
)
def test_outcome_severity(error: str, exception: BaseException | None, severity: int) -> None:
    assert RankOutcome(rank=0, ok=False, error=error, exception=exception).severity == severity


def test_a_short_collective_timeout_does_not_shorten_the_start() -> None:
    # timeout_s=30 fails fast on a hung peer; starting workers on a busy host still gets 300 s
    assert JobSpec(fn=_raise_value_error, num_workers=1, timeout_s=30).start_s == 300.0
    assert JobSpec(fn=_raise_value_error, num_workers=1, timeout_s=900).start_s == 900.0
    assert (
        JobSpec(fn=_raise_value_error, num_workers=1, timeout_s=30, start_timeout_s=5).start_s
        == 5.0
    )


class _StaleClient:
    """A Dask client whose scheduler query fails as on a busy host: ``scheduler_info()`` then
    answers with its cache, which the client's periodic refresh filled with no workers."""

    class _Scheduler:
        def identity(self, n_workers: int = 0) -> dict[str, Any]:
            raise AssertionError("called only through sync")

    def __init__(self) -> None:
        self.scheduler = self._Scheduler()
        self.fail = True

    def scheduler_info(self, n_workers: int = -1) -> dict[str, Any]:
        return {"workers": {}}  # distributed swallows the OSError and returns the cache

    def sync(self, func: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
        if self.fail:
            raise OSError("Timed out trying to connect to the scheduler")
        return {"workers": {"tcp://w0": {}, "tcp://w1": {}}}


class _Pending:
    def done(self) -> bool:
        return False


class _Wait:
    @staticmethod
    def wait(futures: list[Any], timeout: float, return_when: str) -> None:
        raise TimeoutError


def test_dask_liveness_ignores_a_failed_scheduler_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler query that fails is not the news that every worker left (ci61: both ranks of
    a finished job were declared dead from the client's empty cache); the next answer counts."""
    from torsh_distributed.launch import _dask_backend

    monkeypatch.setattr(_dask_backend, "_LIVENESS_EVERY_S", 0.0)
    client = _StaleClient()
    job = _dask_backend._Job(_Wait, client, JobSpec(fn=_noop, num_workers=2), stop_ranks=True)
    job.addresses = ["tcp://w0", "tcp://w1"]
    job.futures = {_Pending(): 0, _Pending(): 1}
    poll = job._poll_fn(["w0", "w1"])
    assert list(poll(0.0)) == []  # unknown, not dead
    client.fail = False
    assert list(poll(0.0)) == []  # both alive
    job.addresses = ["tcp://w0", "tcp://gone"]
    [dead] = poll(0.0)
    assert (dead.rank, dead.died, dead.error) == (1, True, "worker tcp://gone left the cluster")
