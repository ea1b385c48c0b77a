"""The lines the launcher prints when a restart follows a failure, and the agent that prints them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torsh_distributed.elastic._agent import reporting_agent
from torsh_distributed.elastic._bootstrap import error_record
from torsh_distributed.elastic._report import report_restart


def _recorded(tmp_path: Path, exc: Exception, rank: int) -> str:
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001 - a record needs a live traceback
        data = error_record(caught)
    data["torsh"].update(rank=rank, local_rank=rank, group_rank=0)
    path = tmp_path / f"{rank}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_sigkill_is_named_and_the_ranks_the_agent_stopped_are_not_failures() -> None:
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file="/nonexistent"),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file="/nonexistent"),
    }
    out = io.StringIO()
    report_restart(failures, restart=1, max_restarts=3, node=0, num_workers=2, out=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("torsh-dist: rank 1 failed (local rank 1, node 0, host ")
    assert lines[0].endswith("; killed by SIGKILL)")
    assert lines[1] == (
        "torsh-dist: restart 1 of 3 (--max-restarts 3): all 2 worker(s) of this node start again"
    )


def test_an_exception_gives_its_exit_code_and_message_one_line_per_failed_rank(tmp_path) -> None:
    failures = {
        3: ProcessFailure(
            local_rank=1, pid=11, exitcode=1,
            error_file=_recorded(tmp_path, RuntimeError("Connection closed by peer"), 3),
        ),
        2: ProcessFailure(
            local_rank=0, pid=10, exitcode=1, error_file=_recorded(tmp_path, ValueError("bad"), 2)
        ),
    }  # fmt: skip
    out = io.StringIO()
    report_restart(failures, restart=2, max_restarts=2, node=1, num_workers=2, out=out)
    lines = out.getvalue().splitlines()
    # the root cause first (a peer's "connection closed" is a consequence), then the other
    assert lines[0].startswith("torsh-dist: rank 2 failed (local rank 0, node 0, host ")
    assert lines[0].endswith("; exit code 1): ValueError: bad")
    assert lines[1].endswith("; exit code 1): RuntimeError: Connection closed by peer")
    assert lines[2].startswith("torsh-dist: restart 2 of 2 (--max-restarts 2)")


def test_the_reporting_agent_replaces_torchs_only_inside_the_block() -> None:
    assert launcher_api.LocalElasticAgent is LocalElasticAgent
    with reporting_agent(io.StringIO()):
        inner = launcher_api.LocalElasticAgent
        with reporting_agent(io.StringIO()):  # nested (or another thread's) launch
            assert launcher_api.LocalElasticAgent is inner
        assert launcher_api.LocalElasticAgent is inner
    assert inner is not LocalElasticAgent and issubclass(inner, LocalElasticAgent)
    assert launcher_api.LocalElasticAgent is LocalElasticAgent


def test_launch_and_rendezvous_planning_import_no_circle() -> None:
    import ast
    import importlib

    for name in ("_rendezvous", "_options", "_agent", "_report"):
        module = importlib.import_module(f"torsh_distributed.elastic.{name}")
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {
            node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        }  # including imports under TYPE_CHECKING
        assert "torsh_distributed.elastic.launch" not in imported, name
