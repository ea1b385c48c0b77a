"""The warm ClientApp start's pieces that need no federation: the SuperNode's command line by
start method, and ``flwr-clientapp``'s and ``flwr-serverapp``'s command lines equal to the one Flower's own
``SubprocessExecutor`` runs (the deployment itself: tests/integration/test_federated_warm_start.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from torsh_distributed.federated._warm_node import _app_argv
from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.deploy import Federation, supernode_command


def test_supernode_command_by_start_method() -> None:
    warm = supernode_command("127.0.0.1:9092", partition_id=1, num_partitions=2, port=9100)
    assert warm[1:6] == ["-m", "torsh_distributed.federated._warm_node", "--runtime-api-address", "127.0.0.1:9100", "--"]
    # Flower's SuperNode through _flower_polls (its idle poll shortened)
    assert warm[6:9] == [sys.executable, "-m", "torsh_distributed.federated._flower_polls"]
    assert warm[9].endswith("flower-supernode") and warm[10:12] == ["--isolation", "process"]
    assert warm[-2:] == ["--node-config", "partition-id=1 num-partitions=2"]  # regions rewrite the last
    cold = supernode_command("127.0.0.1:9092", partition_id=1, num_partitions=2, port=9100, start_method="spawn")
    assert "--isolation" not in cold and cold == warm[6:10] + warm[12:]
    with pytest.raises(ValueError, match="start_method must be one of forkserver, spawn, got 'fork'"):
        supernode_command("127.0.0.1:9092", partition_id=0, num_partitions=1, port=9100, start_method="fork")
    with pytest.raises(ValueError, match="start_method must be one of forkserver, spawn, got 'thread'"):
        Federation(FederatedConfig(clients=1), start_method="thread")


@pytest.mark.parametrize("task", ["CLIENT_APP", "SERVER_APP"])
@pytest.mark.parametrize("tls", [False, True])
def test_app_command_line_is_flowers_own(monkeypatch: pytest.MonkeyPatch, tls: bool, task: str) -> None:
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor import ExecutionSpec, subprocess_executor

    spec = ExecutionSpec(
        task_type=getattr(TaskType, task), runtime_api_address="127.0.0.1:9100", token="t0k3n", insecure=not tls,
        root_certificates_path="/ca.pem" if tls else None, runtime_dependency_install=tls,
        parent_pid=os.getpid(), suppress_output=False, task_id=7,
    )  # fmt: skip
    started: list[list[str]] = []

    def record(args: list[str], **_: Any) -> None:  # what Flower would have started, not started
        started.append(list(args))

    monkeypatch.setattr(subprocess_executor.subprocess, "Popen", record)
    subprocess_executor.SubprocessExecutor().launch(spec)
    ours = _app_argv(spec)
    assert Path(ours[0]).name == started[0][0] == {"CLIENT_APP": "flwr-clientapp", "SERVER_APP": "flwr-serverapp"}[task]
    assert ours[1:] == started[0][1:]
