"""``torsh_distributed.testing.cli.run_cli``: ``torsh-dist`` in a warm forked process answers as
``subprocess.run`` of the console script would (status, streams, environment, directory, time
limit), and leaves the harness that forked it usable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torsh_distributed.testing import run_distributed
from torsh_distributed.testing.cli import run_cli


def _one() -> int:
    return 1


def test_status_and_streams_are_the_commands(tmp_path: Path) -> None:
    refused = run_cli(["train", "--nproc-per-node", "0"])
    cold = subprocess.run([sys.executable, "-m", "torsh_distributed.cli.main", "train",
                           "--nproc-per-node", "0"], capture_output=True, text=True, timeout=120)
    assert (refused.returncode, refused.stdout, refused.stderr) == (
        cold.returncode, cold.stdout, cold.stderr) == (
        2, "", "torsh-dist train: error: nproc_per_node must be >= 1, got 0\n")
    assert refused.args == ["torsh-dist", "train", "--nproc-per-node", "0"]
    unknown = run_cli(["train", "--no-such-flag"])
    assert unknown.returncode == 2 and "unrecognized arguments: --no-such-flag" in unknown.stderr
    helped = run_cli(["--help"])
    assert helped.returncode == 0 and helped.stdout.startswith("usage: torsh-dist")


def test_environment_directory_and_path_are_the_commands(tmp_path: Path) -> None:
    # a job script that prints what it sees, run by `torsh-dist run` from tmp_path
    (tmp_path / "probe.py").write_text(
        "import os, sys\n"
        "print('CWD', os.getcwd()); print('VAR', os.environ.get('TORSH_PROBE_VAR'))\n"
        "print('TESTS_ON_PATH', any(p.endswith('tests/unit') for p in sys.path))\n"
        "sys.exit(int(os.environ.get('TORSH_PROBE_EXIT', '0')))\n"
    )
    env = {**os.environ, "TORSH_PROBE_VAR": "seen", "TORSH_PROBE_EXIT": "3"}
    done = run_cli(["run", "probe.py"], env=env, cwd=tmp_path)
    assert f"CWD {tmp_path}" in done.stdout and "VAR seen" in done.stdout, done.stdout + done.stderr
    assert "TESTS_ON_PATH False" in done.stdout  # the interpreter's path, not the test runner's
    assert done.returncode != 0 and "exit" in done.stderr.lower(), done.stderr
    assert "TORSH_PROBE_VAR" not in os.environ  # this process's environment is untouched


def test_the_processes_holding_a_commands_output_are_found(tmp_path: Path) -> None:
    # run_cli returns once nobody holds the command's output, as subprocess.run's pipes do
    from torsh_distributed.testing.cli import _holding

    log = tmp_path / "out.txt"
    with log.open("w") as sink:
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=sink)
    try:
        assert _holding(log, tmp_path / "other.txt") == {holder.pid}
    finally:
        holder.kill()
        holder.wait()
    assert _holding(log) == set()


def test_a_command_past_its_time_is_killed_with_what_it_wrote(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_cli(["run", "hang.py"], cwd=tmp_path, timeout=8)
    assert time.monotonic() - start < 60
    assert "started" in (caught.value.output or "")
    assert run_distributed(_one, 2, timeout=60) == [1, 1]  # the harness's forkserver still serves


def test_a_started_command_runs_until_stopped_and_writes_both_streams_to_its_file(tmp_path: Path) -> None:
    from torsh_distributed.testing.cli import start_cli

    (tmp_path / "wait.py").write_text(
        "import sys, time\nprint('out line', flush=True)\nprint('err line', file=sys.stderr, flush=True)\n"
        "time.sleep(600)\n"
    )
    from torsh_distributed.testing.cli import kill_tree

    log = tmp_path / "log.txt"
    proc = start_cli(["run", "wait.py"], output=log, cwd=tmp_path)
    try:
        assert log.exists() and proc.args == ["torsh-dist", "run", "wait.py"]
        deadline = time.monotonic() + 120
        while "err line" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert "out line" in log.read_text() and "err line" in log.read_text()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        assert os.getpgid(proc.pid) == proc.pid  # its own process group, as start_new_session=True
    finally:
        kill_tree(proc.pid)  # the worker too: torch's agent starts it in a session of its own
    assert proc.wait(30) == -9 and proc.returncode == -9 and proc.poll() == -9
