"""`torsh_distributed.launch.dask` on a real Dask LocalCluster (two worker processes per module)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

distributed = pytest.importorskip(
    "distributed",
    reason="Dask's distributed is not installed: pip install 'torsh-distributed[dask]'",
)

import _launch_common as common  # noqa: E402

from torsh_distributed import launch  # noqa: E402
from torsh_distributed.runtime.errors import (  # noqa: E402
    DistributedTimeoutError,
    ProcessFailureError,
)
from torsh_distributed.train.trainer import train  # noqa: E402


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """Two single-threaded worker processes with nannies on 127.0.0.1; closed at the end.

    These tests end worker processes on purpose, several times. A LocalCluster closes a nanny
    for good when its worker is missing at the moment ``lost-worker-timeout`` (15 s) after an
    earlier loss of a worker of the same name, so two kills 15 s apart can cost a worker (Dask's
    behaviour, see docs/ray-dask.md); the timeout is raised while the module runs.
    """
    import dask

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "1h"}):
        cluster = distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        try:
            with distributed.Client(cluster) as dask_client:
                yield dask_client
        finally:
            cluster.close()


@pytest.mark.timeout(120)
def test_all_reduce_on_two_workers(client: Any) -> None:
    results = launch.dask(
        common.all_reduce_rank,
        num_workers=2,
        args=(1.0,),
        timeout_s=60,
        client=client,
        env={"TORSH_TEST_MARK": "x"},
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # (0 + 1) + (1 + 1)
    assert results[0]["pid"] != results[1]["pid"]
    env0, env1 = results[0]["env"], results[1]["env"]
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] == "127.0.0.1"
    assert env0["MASTER_PORT"] == env1["MASTER_PORT"] != "29500"
    assert env0["GLOO_SOCKET_IFNAME"] == "lo" and env1["LOCAL_RANK"] == "1"
    assert env0["TORSH_TEST_MARK"] == "x"
    # Worker processes outlive the call: the job's variables must not stay behind in them.
    leftover = client.run(
        lambda: {k: __import__("os").environ.get(k) for k in ("RANK", "TORSH_TEST_MARK")}
    )
    assert all(v == {"RANK": None, "TORSH_TEST_MARK": None} for v in leftover.values()), leftover


@pytest.mark.timeout(120)
def test_ranks_run_with_the_worker_profiler_paused(client: Any) -> None:
    # The profiler's sys._current_frames() can freeze a CPython 3.11 worker for good while a
    # rank allocates (a rank stuck mid-forward, its peer waiting out its timeout, the worker
    # deaf to the launcher's stop): the launcher pauses it for the rank and restores it.
    assert launch.dask(common.profiler_running, num_workers=2, timeout_s=60, client=client) == [
        False,
        False,
    ]
    after = client.run(lambda dask_worker: dask_worker.periodic_callbacks["profile"].is_running())
    assert list(after.values()) == [True, True], after


@pytest.mark.timeout(240)
def test_training_matches_torsh_dist_train(client: Any) -> None:
    reference = common.reference_summary()
    results = launch.dask(
        train, num_workers=2, args=(common.train_config(),), timeout_s=120, client=client
    )
    assert len(results) == 2
    assert results[0].losses == results[1].losses
    common.assert_same_run(results[0], reference)


@pytest.mark.timeout(120)
def test_rank_error_names_rank_and_stops_the_other(client: Any, tmp_path: Path) -> None:
    mark = tmp_path / "rank0_pid"
    with pytest.raises(ProcessFailureError, match=r"rank 1 of 2 failed .*bad shard 7") as info:
        launch.dask(
            common.fail_on_rank_1, num_workers=2, args=(str(mark),), timeout_s=300, client=client
        )
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert "fail_on_rank_1" in str(info.value)  # the rank's own traceback
    # Rank 0 was blocked in a collective with a 300 s timeout: the launcher ended its process.
    assert common.process_gone(int(mark.read_text()))


@pytest.mark.timeout(120)
def test_hung_rank_gives_timeout_error_and_frees_the_worker(
    client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout_s = 4.0
    mark = tmp_path / "waiting_since"
    timeline = common.HangTimeline()
    timeline.watch(monkeypatch)
    with pytest.raises(DistributedTimeoutError, match=r"rank 0 of 2 timed out") as info:
        launch.dask(
            common.hang_on_rank_1,
            num_workers=2,
            args=(600.0, str(mark)),
            timeout_s=timeout_s,
            start_timeout_s=60,
            client=client,
        )
    timeline.check(mark, timeout_s)
    assert "rank(s) 1 had not finished and were stopped" in str(info.value)
    # The hung rank's worker was replaced: the cluster is usable again at once.
    assert [
        r["sum"]
        for r in launch.dask(
            common.all_reduce_rank, num_workers=2, args=(0.0,), timeout_s=30, client=client
        )
    ] == [1.0, 1.0]


@pytest.mark.timeout(300)
def test_killed_worker_fails_fast_and_rerun_resumes(client: Any, tmp_path: Path) -> None:
    reference = common.reference_summary()
    config = common.train_config("--checkpoint-dir", str(tmp_path / "ck"), *common.CHECKPOINTS)
    log = tmp_path / "faults.jsonl"
    timeout_s = 30.0
    fault = {"TORSH_FAULT": f"kill:rank=1:step={common.KILL_AT_STEP}", "TORSH_FAULT_LOG": str(log)}
    with pytest.raises(ProcessFailureError, match=r"rank 1 of 2 died") as info:
        launch.dask(
            train, num_workers=2, args=(config,), timeout_s=timeout_s, env=fault, client=client
        )
    detected_after = time.time() - common.kill_time(log)
    assert detected_after < timeout_s + 10, detected_after
    assert info.value.rank == 1

    # The nanny restarted the killed worker; the rerun waits for it and resumes.
    results = launch.dask(train, num_workers=2, args=(config,), timeout_s=120, client=client)
    assert results[0].checkpoint["resumed_step"] == 3
    common.assert_same_run(results[0], reference)
