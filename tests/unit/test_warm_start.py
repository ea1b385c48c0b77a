"""The warm worker start (``elastic._warm``): what a forked worker's environment becomes, and the
option's validation. The end-to-end parity with spawned workers is
tests/integration/test_launcher.py::test_forkserver_workers_see_what_spawned_ones_see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torsh_distributed.elastic import _warm
from torsh_distributed.elastic._options import LaunchOptions


def test_start_method_is_validated_by_name() -> None:
    assert LaunchOptions().start_method == "forkserver"
    assert LaunchOptions(start_method="spawn").start_method == "spawn"
    with pytest.raises(ValueError, match="start_method must be one of forkserver, spawn, got 'fork'"):
        LaunchOptions(start_method="fork")


def test_a_forked_worker_gets_the_launcher_env_with_the_agent_vars_on_top(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # as in a worker forked from the forkserver: BASE_ENV is the forkserver's environment, the
    # agent then set RANK and changed OMP_NUM_THREADS; the launcher's env at launch differs
    base = {"PATH": "/bin", "OLD_ONLY": "1", "OMP_NUM_THREADS": "8", "SAME": "x"}
    monkeypatch.setattr(_warm, "BASE_ENV", base)
    monkeypatch.setattr(_warm, "_BASE_PID", os.getpid() + 1)  # "imported in another process"
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update({**base, "RANK": "3", "OMP_NUM_THREADS": "1"})
        launcher = {"PATH": "/bin", "SAME": "x", "OMP_NUM_THREADS": "4", "TORSH_JOB_ID": "j",
                    "RANK": "99"}
        _warm.adopt_environment(launcher)
        got = dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    # the launcher's variables, the agent's values winning; what only the forkserver had is gone
    assert got == {"PATH": "/bin", "SAME": "x", "OMP_NUM_THREADS": "1", "TORSH_JOB_ID": "j",
                   "RANK": "3"}


def test_without_a_preloaded_base_only_missing_variables_are_added(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_warm, "_BASE_PID", os.getpid())  # imported here: no forkserver base
    saved = dict(os.environ)
    try:
        os.environ.pop("TORSH_JOB_ID", None)
        os.environ["RANK"] = "2"
        _warm.adopt_environment({"RANK": "99", "TORSH_JOB_ID": "j"})
        got = (os.environ["RANK"], os.environ["TORSH_JOB_ID"])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert got == ("2", "j")


def test_preload_names_the_engine_only_for_our_own_modules() -> None:
    assert _warm.preload_for(None)[:4] == [
        "torsh_distributed.elastic._warm",  # first: the forkserver's own environment, before any preload
        "torsh_distributed.runtime._omp_wait",  # before torch loads OpenMP
        "torch",
        "torch._dynamo",
    ]
    assert "torsh_distributed.engine.engine" in _warm.preload_for("torsh_distributed.train")
    assert "torsh_distributed.engine.engine" not in _warm.preload_for("mypkg.train")


def test_importing_the_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, torsh_distributed.elastic._warm, torsh_distributed.elastic._options, "
            "torsh_distributed.runtime._omp_wait; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr



def test_a_forked_worker_keeps_its_exit_code_after_its_atexit_handlers(tmp_path: Path) -> None:
    """``run_worker`` in a process forked from a forkserver runs the script's atexit handlers
    (as a fresh interpreter would) and still exits with the script's code: the forkserver's own
    fast exit (``_warm._exit_now``) is armed only in the forkserver itself, never in a worker
    (here one whose forkserver did not preload ``_warm``, so the worker imports it)."""
    user = tmp_path / "user.py"
    user.write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: open('ran_atexit', 'w').close())\n"
        "sys.exit(3)\n"
    )
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import multiprocessing as mp, os, sys\n"
        "def child(user):\n"
        "    from torsh_distributed.elastic._bootstrap import run_worker\n"
        "    from torsh_distributed.elastic import _warm\n"
        "    print('armed', _warm._in_forkserver(), flush=True)\n"
        "    run_worker(dict(os.environ), os.getcwd(), [user])\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('forkserver')\n"
        "    ctx.set_forkserver_preload(['json'])\n"
        "    p = ctx.Process(target=child, args=(sys.argv[1],))\n"
        "    p.start(); p.join()\n"
        "    print('exitcode', p.exitcode, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, str(probe), str(user)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["armed", "False", "exitcode", "3"], out.stdout + out.stderr
    assert (tmp_path / "ran_atexit").exists()


_FORK_PROBE = """
import json, multiprocessing as mp, os, sys, threading
if __name__ == '__main__':
    held_r, held_w = os.pipe()  # a pipe the launcher holds: the forked server must not
    if sys.argv[1] == "thread":  # a Python thread besides the main one: no fork
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    from torsh_distributed.elastic import _warm
    from multiprocessing import forkserver
    if sys.argv[1] != "library":  # the console script says so; main() called by others does not
        _warm.allow_fork()
    _warm.prestart(["torsh_distributed.elastic._warm", "torch"], fork=True)
    server = forkserver._forkserver._forkserver_pid
    p = mp.get_context("forkserver").Process(target=os._exit, args=(7,))
    p.start(); p.join()
    pipe = "pipe:[%d]" % os.fstat(held_w).st_ino
    fds = []
    for fd in os.listdir(f"/proc/{server}/fd"):
        try:
            fds.append(os.readlink(f"/proc/{server}/fd/{fd}"))
        except OSError:
            pass
    with open(f"/proc/{server}/cmdline", "rb") as f:
        cmdline = f.read().decode()
    print(json.dumps({"server": server, "exitcode": p.exitcode, "holds_pipe": pipe in fds,
                      "fresh": "forkserver import main" in cmdline}), flush=True)
"""


def _gone(pid: int, within_s: float) -> bool:
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("state", ["cli", "thread", "library"])
def test_prestart_forks_the_server_from_the_command_only(tmp_path: Path, state: str) -> None:
    """``prestart(fork=True)`` in the command's own process (``allow_fork``, one Python thread)
    forks the forkserver from it (torch imported once): the server serves the stdlib's protocol
    (a worker's exit code comes back), holds none of the launcher's descriptors (a caller reading
    the launcher's pipe would never see its end) and ends with the launcher. With another Python
    thread running, or in a process that did not say it is the command (the CLI's ``main()``
    called from a notebook or a test), it starts the stdlib's fresh interpreter instead. Fails if
    the fork leaks the pipe, outlives the launcher, or forks where it should not."""
    import json

    probe = tmp_path / "probe.py"
    probe.write_text(_FORK_PROBE)
    out = subprocess.run(
        [sys.executable, str(probe), state], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["exitcode"] == 7
    assert seen["fresh"] is (state != "cli")
    assert seen["holds_pipe"] is False
    assert _gone(seen["server"], within_s=30), "the forkserver outlived its launcher"


def test_the_forked_server_is_refused_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_warm, "_FORK_ALLOWED", True)
    monkeypatch.setattr("threading.active_count", lambda: 1)
    assert _warm._may_fork()
    monkeypatch.setenv("TORSH_WARM_FORK", "0")
    assert not _warm._may_fork()
