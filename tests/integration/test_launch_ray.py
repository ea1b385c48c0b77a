"""`torsh_distributed.launch.ray` on a real local Ray cluster (one per module, 2 CPUs' worth)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip(
    "ray", reason="Ray is not installed: pip install 'torsh-distributed[ray]'"
)

import _launch_common as common  # noqa: E402

from torsh_distributed import launch  # noqa: E402
from torsh_distributed.runtime.errors import (  # noqa: E402
    DistributedTimeoutError,
    ProcessFailureError,
)
from torsh_distributed.train.trainer import train  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster whose workers can import the test helpers; shut down at the end."""
    path = os.pathsep.join(filter(None, [str(common.HERE), os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.timeout(120)
def test_all_reduce_on_two_actors(ray_cluster: None) -> None:
    results = launch.ray(
        common.all_reduce_rank,
        num_workers=2,
        args=(1.0,),
        timeout_s=60,
        env={"TORSH_TEST_MARK": "x"},
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # (0 + 1) + (1 + 1)
    assert results[0]["pid"] != results[1]["pid"]
    assert {r["backend"] for r in results} == {"gloo+shm"}  # `auto`, two actors on one host
    env0, env1 = results[0]["env"], results[1]["env"]
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] == "127.0.0.1"  # one node: loopback only
    assert env0["MASTER_PORT"] == env1["MASTER_PORT"] != "29500"
    assert env0["GLOO_SOCKET_IFNAME"] == "lo" and env1["LOCAL_RANK"] == "1"
    assert env0["LOCAL_WORLD_SIZE"] == "2" and env0["TORSH_TEST_MARK"] == "x"


@pytest.mark.timeout(240)
def test_training_matches_torsh_dist_train(ray_cluster: None) -> None:
    reference = common.reference_summary()
    results = launch.ray(train, num_workers=2, args=(common.train_config(),), timeout_s=120)
    assert len(results) == 2
    assert results[0].losses == results[1].losses  # every rank reports the global mean
    common.assert_same_run(results[0], reference)


@pytest.mark.timeout(120)
def test_rank_error_names_rank_and_stops_the_other(ray_cluster: None, tmp_path: Path) -> None:
    mark = tmp_path / "rank0_pid"
    with pytest.raises(ProcessFailureError, match=r"rank 1 of 2 failed .*bad shard 7") as info:
        launch.ray(common.fail_on_rank_1, num_workers=2, args=(str(mark),), timeout_s=300)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert "fail_on_rank_1" in str(info.value)  # the rank's own traceback
    # Rank 0 was blocked in a collective with a 300 s timeout: the launcher ended its process.
    assert common.process_gone(int(mark.read_text()))


@pytest.mark.timeout(120)
def test_hung_rank_gives_timeout_error_within_timeout(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout_s = 4.0
    mark = tmp_path / "waiting_since"
    timeline = common.HangTimeline()
    timeline.watch(monkeypatch)
    with pytest.raises(DistributedTimeoutError, match=r"rank 0 of 2 timed out") as info:
        launch.ray(
            common.hang_on_rank_1,
            num_workers=2,
            args=(600.0, str(mark)),
            timeout_s=timeout_s,
            start_timeout_s=60,
        )
    timeline.check(mark, timeout_s)
    assert "rank(s) 1 had not finished and were stopped" in str(info.value)


@pytest.mark.timeout(300)
def test_killed_worker_fails_fast_and_rerun_resumes(ray_cluster: None, tmp_path: Path) -> None:
    reference = common.reference_summary()
    config = common.train_config("--checkpoint-dir", str(tmp_path / "ck"), *common.CHECKPOINTS)
    log = tmp_path / "faults.jsonl"
    timeout_s = 30.0
    fault = {"TORSH_FAULT": f"kill:rank=1:step={common.KILL_AT_STEP}", "TORSH_FAULT_LOG": str(log)}
    with pytest.raises(ProcessFailureError, match=r"rank 1 of 2 died") as info:
        launch.ray(train, num_workers=2, args=(config,), timeout_s=timeout_s, env=fault)
    detected_after = time.time() - common.kill_time(log)
    assert detected_after < timeout_s + 10, detected_after
    assert info.value.rank == 1

    results = launch.ray(train, num_workers=2, args=(config,), timeout_s=120)
    assert results[0].checkpoint["resumed_step"] == 3
    common.assert_same_run(results[0], reference)
