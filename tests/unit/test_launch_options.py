"""LaunchOptions validation, the run CLI's parsing, the worker bootstrap and the failure report."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from torsh_distributed.cli.main import build_parser
from torsh_distributed.cli.run import options_from_args
from torsh_distributed.elastic import LaunchOptions, launch
from torsh_distributed.elastic._bootstrap import error_record
from torsh_distributed.elastic._report import report_failure as _report
from torsh_distributed.elastic.launch import parse_nnodes


def test_defaults_describe_one_local_process() -> None:
    options = LaunchOptions()
    assert (options.nproc_per_node, options.min_nodes, options.max_nodes) == (1, 1, 1)
    assert options.master_addr == "127.0.0.1" and options.master_port is None
    assert options.max_restarts == 0 and options.env == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nproc_per_node": 0}, "nproc_per_node must be >= 1"),
        ({"nnodes": "a:b"}, "nnodes must be 'N' or 'MIN:MAX'"),
        ({"nnodes": "1:2:3"}, "nnodes must be 'N' or 'MIN:MAX'"),
        ({"nnodes": "2:1"}, "nnodes must satisfy 1 <= MIN <= MAX"),
        ({"nnodes": "0"}, "nnodes must satisfy"),
        ({"nnodes": "1:2"}, "needs rdzv_endpoint"),
        ({"nnodes": "2", "node_rank": 2}, "node_rank must be < nnodes"),
        ({"node_rank": -1}, "node_rank must be >= 0"),
        ({"master_port": 0}, "master_port must be in"),
        ({"master_port": 70000}, "master_port must be in"),
        ({"master_addr": " "}, "master_addr"),
        ({"rdzv_backend": "etcd"}, "rdzv_backend must be one of c10d, static"),
        ({"rdzv_endpoint": "host:notaport"}, "rdzv_endpoint"),
        ({"rdzv_id": ""}, "rdzv_id"),
        ({"max_restarts": -1}, "max_restarts must be >= 0"),
        ({"monitor_interval": 0}, "monitor_interval must be > 0"),
        ({"master_timeout": 0}, "master_timeout must be > 0"),
        ({"local_ranks_filter": {2}}, "local_ranks_filter"),
        ({"env": {"A=B": "1"}}, "env must map"),
        ({"env": {"A": 1}}, "env must map"),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LaunchOptions(**kwargs)


def test_wrong_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match="nproc_per_node must be an int"):
        LaunchOptions(nproc_per_node="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nnodes must be a str"):
        LaunchOptions(nnodes=2)  # type: ignore[arg-type]


def test_elastic_range_is_accepted_with_a_c10d_endpoint() -> None:
    options = LaunchOptions(nnodes="1:4", rdzv_endpoint="head:29400", max_restarts=3)
    assert (options.min_nodes, options.max_nodes) == (1, 4)


def test_ignored_settings_warn() -> None:
    with pytest.warns(UserWarning, match="node_rank=1 is ignored"):
        LaunchOptions(nnodes="2", node_rank=1, rdzv_endpoint="head:29400")
    with pytest.warns(UserWarning, match="master_addr/master_port are ignored"):
        LaunchOptions(master_port=1234, rdzv_endpoint="head:29400")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LaunchOptions(nnodes="2", node_rank=1, master_addr="10.0.0.1")  # static: used, no warning


def test_parse_nnodes() -> None:
    assert parse_nnodes("3") == (3, 3)
    assert parse_nnodes("1:4") == (1, 4)


def test_launch_rejects_bad_targets_before_starting_anything(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run')\n")
    options = LaunchOptions()
    with pytest.raises(ValueError, match="exactly one of script= .* and module="):
        launch(options, script=str(script), module="pkg.mod")
    with pytest.raises(ValueError, match="exactly one of script="):
        launch(options)
    with pytest.raises(ValueError, match="is not a file"):
        launch(options, script=str(tmp_path / "missing.py"))
    with pytest.raises(TypeError, match="args must be a sequence of str"):
        launch(options, script=str(script), args="--lr 1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options must be a LaunchOptions"):
        launch({"nproc_per_node": 2}, script=str(script))  # type: ignore[arg-type]


def test_cli_accepts_torchrun_spellings_and_passes_script_args_through() -> None:
    args = build_parser().parse_args(
        ["run", "--nproc_per_node", "3", "--nnodes", "2", "--node_rank", "1",
         "--master_addr", "10.0.0.1", "--master_port", "1234", "--max_restarts", "2",
         "--master-timeout", "3", "train.py", "--lr", "1e-3", "--nnodes", "9"]
    )  # fmt: skip
    assert args.script == "train.py" and not args.module
    assert args.script_args == ["--lr", "1e-3", "--nnodes", "9"]
    options = options_from_args(args)
    assert (options.nproc_per_node, options.nnodes, options.node_rank) == (3, "2", 1)
    assert (options.master_addr, options.master_port, options.max_restarts) == ("10.0.0.1", 1234, 2)
    assert options.master_timeout == 3.0
    assert options_from_args(build_parser().parse_args(["run", "x.py"])).master_timeout == 10.0


def test_cli_module_form_and_bad_nproc() -> None:
    parser = build_parser()
    args = parser.parse_args(["run", "-m", "pkg.train", "--epochs", "3"])
    assert args.module and args.script == "pkg.train" and args.script_args == ["--epochs", "3"]
    args = parser.parse_args(["run", "--nproc-per-node", "many", "x.py"])
    with pytest.raises(ValueError, match="nproc_per_node must be an integer, 'gpu', 'cpu' or"):
        options_from_args(args)
    args = parser.parse_args(["run", "--local-ranks-filter", "0,x", "x.py"])
    with pytest.raises(ValueError, match="local_ranks_filter"):
        options_from_args(args)


# --- the worker bootstrap ---------------------------------------------------------------------


def test_bootstrap_records_the_exception_and_prints_no_traceback(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            assert __name__ == "__main__" and sys.argv[1:] == ["--x", "1"], sys.argv
            def inner():
                raise ValueError("boom from user code")
            inner()
            """
        )
    )
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file), "RANK": "3"}
    result = subprocess.run(
        [sys.executable, "-m", "torsh_distributed.elastic._bootstrap", str(script), "--x", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "boom" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    data = json.loads(error_file.read_text())
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert data["message"]["message"] == "ValueError: boom from user code"
    assert "in inner" in callstack and "in <module>" in callstack
    assert "_bootstrap.py" not in callstack and "runpy" not in callstack  # wrapper frames dropped
    assert data["torsh"]["rank"] == 3 and data["torsh"]["exception"] == "ValueError"


def test_bootstrap_without_error_file_prints_the_traceback(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("raise KeyError('no launcher here')\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    result = subprocess.run(
        [sys.executable, "-m", "torsh_distributed.elastic._bootstrap", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "KeyError: 'no launcher here'" in result.stderr


# --- the failure report -----------------------------------------------------------------------


def _recorded(tmp_path: Path, name: str, exc: Exception, time_ns: int, rank: int) -> str:
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001 - building a record needs a live traceback
        data = error_record(caught)
    data["torsh"].update(time_ns=time_ns, rank=rank, local_rank=rank, group_rank=0)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_report_blames_the_primary_failure_even_when_a_victim_failed_first(tmp_path: Path) -> None:
    victim = _recorded(tmp_path, "0.json", RuntimeError("Connection closed by peer"), 1, 0)
    culprit = _recorded(tmp_path, "1.json", ValueError("the real bug"), 2, 1)
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=victim),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=7, error_file=culprit),
        2: ProcessFailure(local_rank=2, pid=12, exitcode=-15, error_file="/nonexistent"),
    }
    out = io.StringIO()
    code = _report(ChildFailedError("job", failures), node=0, log_dir=None, out=out)
    text = out.getvalue()
    assert code == 7  # one primary failure: its exit code
    assert text.startswith("torsh-dist: rank 1 failed (local rank 1, node 0, host ")
    assert text.count("ValueError: the real bug") == 1
    assert "  rank 0 (local rank 0): RuntimeError: Connection closed by peer (exit code 1)" in text
    assert "stopped by the launcher after the failure: ranks 2" in text


def test_report_exit_code_is_one_for_several_primary_failures(tmp_path: Path) -> None:
    first = _recorded(tmp_path, "0.json", ValueError("a"), 5, 0)
    second = _recorded(tmp_path, "1.json", KeyError("b"), 9, 1)
    failures = {
        1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=second),
        0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=first),
    }
    out = io.StringIO()
    assert _report(ChildFailedError("job", failures), node=None, log_dir=None, out=out) == 1
    assert out.getvalue().startswith("torsh-dist: rank 0 failed")  # the earlier one


def test_report_of_a_crash_without_traceback(tmp_path: Path) -> None:
    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=-11, error_file="/nonexistent")}
    out = io.StringIO()
    assert _report(ChildFailedError("job", failures), node=0, log_dir=None, out=out) == 139
    assert "killed by SIGSEGV" in out.getvalue()


def test_the_node_hosting_the_rendezvous_says_what_it_waits_for_and_how_to_join() -> None:
    """Node 0 of a multi-node job used to wait up to the rendezvous timeout without a word."""
    from torsh_distributed.elastic._rendezvous import plan
    from torsh_distributed.elastic.launch import _hosting_line

    two = LaunchOptions(nnodes="2", master_addr="10.0.0.1", master_port=29500)
    assert _hosting_line(two, plan(two), "10.0.0.1", 29500) == (
        "torsh-dist: node 0 of 2 hosts the rendezvous at 10.0.0.1:29500 and waits up to 900 s for "
        "the other node: start it with the same command and --node-rank 1 --master-addr 10.0.0.1 "
        "--master-port 29500"
    )
    four = LaunchOptions(nnodes="4", master_port=29501)
    line = _hosting_line(four, plan(four), "127.0.0.1", 29501)
    assert "for the other 3 nodes: start them with the same command and --node-rank 1 to 3" in line
    assert line.endswith("(127.0.0.1: only nodes on this machine reach it)")
    elastic = LaunchOptions(nnodes="2:3", rdzv_endpoint="10.0.0.1:29400",
                            rdzv_conf={"join_timeout": "120"})
    assert _hosting_line(elastic, plan(elastic), "10.0.0.1", 29400) == (
        "torsh-dist: this node hosts the rendezvous at 10.0.0.1:29400 (c10d, 2 to 3 nodes, waiting "
        "up to 120 s for 2); other nodes join with the same command and --nnodes 2:3 "
        "--rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400"
    )
    static = LaunchOptions(nnodes="2", rdzv_endpoint="10.0.0.1:29400", rdzv_backend="static")
    assert _hosting_line(static, plan(static), "10.0.0.1", 29400).endswith(
        "--node-rank 1 --rdzv-backend static --rdzv-endpoint 10.0.0.1:29400"
    )
