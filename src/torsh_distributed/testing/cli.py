"""Run ``torsh-dist`` commands in tests without a cold interpreter each time.

:func:`run_cli` runs ``torsh-dist ARGV`` as :func:`subprocess.run` would, and returns the same
:class:`subprocess.CompletedProcess`, but in a process forked from the harness's forkserver
(:mod:`torsh_distributed.testing.harness`), which imported torch once per session, and what
``TORSH_TEST_PRELOAD`` names (the suite's ``tests/conftest.py``: the engine and the trainer). A cold ``python -m torsh_distributed.cli.main`` spends about 3.5 CPU-seconds of a 2-core
VM importing them before it parses its first flag; a test file that runs a dozen commands pays
that a dozen times. Everything after the interpreter's start runs as in the console script: the
process is its own session and process group, its environment, working directory, ``sys.argv``
and ``sys.path`` are the command's, its standard streams are files, it may fork its workers'
forkserver from itself, its ``atexit`` handlers run, and its exit status is the command's
(negative: killed by that signal).

What only a cold start can show (which modules a command imports, how long ``--help`` takes, the
console script's own exit path) is tested with real subprocesses (``tests/unit/test_cli_startup.py``);
commands that must run in a network namespace are started with ``ip netns exec`` as before.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torsh_distributed.testing.harness import _context, omp_threads

__all__ = ["WarmProcess", "kill_tree", "run_cli", "start_cli"]


class WarmProcess:
    """A ``torsh-dist`` command started by :func:`start_cli`: the parts of
    :class:`subprocess.Popen` tests use (``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``). It leads its own process group, as with
    ``start_new_session=True``."""

    def __init__(self, argv: list[str], process: Any) -> None:
        self.args = ["torsh-dist", *argv]
        self._process = process
        self.pid: int = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = int(self._process.exitcode)
            _LIVE.discard(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def lines(self, output: str | os.PathLike[str], *, poll_s: float = 0.02) -> Iterator[str]:
        """The lines of ``output`` (the file given to :func:`start_cli`) as they are written,
        until the command has exited and all it wrote was read (``for line in proc.stdout``)."""
        with open(output, errors="replace") as stream:
            pending = ""
            while True:
                exited = self.poll() is not None  # before the read: nothing written after it
                chunk = stream.read()
                if chunk:
                    pending += chunk
                    *done, pending = pending.split("\n")
                    yield from (line + "\n" for line in done)
                    continue
                if exited:
                    if pending:
                        yield pending
                    return
                time.sleep(poll_s)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_cli(
    argv: Sequence[str],
    *,
    output: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> WarmProcess:
    """Start ``torsh-dist ARGV`` in a warm process and return at once (``subprocess.Popen``'s
    use in tests: a server, a run stopped by a signal). Its stdout and stderr both go to the
    file ``output`` (created or truncated), as with ``stdout=f, stderr=subprocess.STDOUT``."""
    Path(output).write_bytes(b"")  # there (and empty) when this returns
    args, process = _start(argv, env, cwd, output, output)
    return WarmProcess(args, process)


def run_cli(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess[str]:
    """``torsh-dist ARGV`` in a warm process; what ``subprocess.run(..., capture_output=True,
    text=True)`` returns for it.

    Args:
        argv: The command's arguments (``["train", "--max-steps", "5"]``).
        env: Its whole environment (``os.environ`` when ``None``), as ``subprocess.run``'s.
        cwd: Its working directory (this process's when ``None``); also first on ``sys.path``,
            as for ``python -m``.
        timeout: Seconds; past them the command's process group is killed and
            :class:`subprocess.TimeoutExpired` raised with what it had written.
    """
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="torsh-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        args, proc = _start(argv, env, cwd, out, err)
        holders: set[int] = set()
        try:
            proc.join(timeout)
            # as subprocess.run: done when every process that holds its output let go (its
            # workers' forkserver a moment after it), or the time is up
            while proc.exitcode is not None:
                holders = _holding(out, err)
                if not holders or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except BaseException:  # pytest's timeout, Ctrl-C: the command goes with the test
            kill_tree(proc.pid)
            proc.join(10)
            raise
        if proc.exitcode is None or holders:
            for pid in {proc.pid, *holders}:
                kill_tree(pid)  # the command and every process it started
            proc.join(10)
            raise subprocess.TimeoutExpired(
                ["torsh-dist", *args], timeout, output=_read(out), stderr=_read(err)
            )
        _LIVE.discard(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(
            ["torsh-dist", *args], int(proc.exitcode), _read(out), _read(err)
        )


def _holding(*paths: Path) -> set[int]:
    """The processes with one of ``paths`` open (read from ``/proc``; none where it is missing)."""
    wanted = {str(p.resolve()) for p in paths}
    found: set[int] = set()
    for entry in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if os.readlink(entry) in wanted:
                found.add(int(entry.parts[2]))
    found.discard(os.getpid())
    return found


def _start(
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike[str] | None,
    out: str | os.PathLike[str],
    err: str | os.PathLike[str],
) -> tuple[list[str], Any]:
    """The command's arguments as strings, and its started process."""
    args = [str(a) for a in argv]
    environ = dict(os.environ if env is None else env)
    where = str(Path(cwd) if cwd is not None else Path.cwd())
    paths = (os.path.abspath(out), os.path.abspath(err))  # the child changes directory first
    process = _context().Process(  # type: ignore[attr-defined]
        target=_command, args=(args, environ, where, *paths, _default_path()), daemon=False
    )
    process.start()
    _LIVE.add(process.pid)
    return args, process


_LIVE: set[int] = set()
"""Commands started and not seen to end: killed with their trees when this process exits, before
multiprocessing's own exit handler would wait for them (a test stopped by its timeout)."""


@atexit.register
def _kill_live() -> None:
    import psutil

    for pid in list(_LIVE):
        with contextlib.suppress(psutil.Error):
            if not _is_forkserver_child(pid):
                continue  # that pid is someone else's now
            kill_tree(pid)


def _is_forkserver_child(pid: int) -> bool:
    """Whether ``pid``'s parent is a forkserver of this process (how commands are started)."""
    import psutil

    parent = psutil.Process(pid).parent()
    return parent is not None and parent.ppid() == os.getpid()


@functools.cache
def _default_path() -> list[str]:
    """``sys.path`` of a fresh interpreter here without ``PYTHONPATH`` (stdlib, site-packages,
    the editable install), less its first entry (the script's or working directory)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        capture_output=True, text=True, env=env, check=True, timeout=60,
    )  # fmt: skip
    return list(json.loads(done.stdout))


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every process below it (torch's agent starts each
    worker in a session of its own, out of the group's reach)."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _command(
    argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, path: list[str]
) -> None:
    """The forked process: become the command, run it, exit with its status."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # as `python -m`: the working directory, PYTHONPATH, then the interpreter's own path (not the
    # test runner's, which holds the test directories)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *path]
    sys.argv = ["torsh-dist", *argv]
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)  # unset, as in a fresh interpreter
    from torsh_distributed.runtime.busy import sleeping_openmp_waits

    sleeping_openmp_waits()  # the console script's first act: its processes inherit the choice
    for fd, path in ((1, out), (2, err)):
        if fd == 2 and err == out:  # one file for both, as stderr=subprocess.STDOUT
            os.dup2(1, 2)
            continue
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threads = omp_threads(env)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    code = 1
    try:
        from torsh_distributed.cli.main import main
        from torsh_distributed.elastic import _warm

        _warm.allow_fork()  # as the console script: its workers' forkserver may fork from it
        code = main(argv)
    except SystemExit as exc:  # argparse's errors and --help, sys.exit in a handler
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter: threads first
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(BaseException):
                if stream is not None:
                    stream.flush()
    os._exit(code if isinstance(code, int) else 1)
