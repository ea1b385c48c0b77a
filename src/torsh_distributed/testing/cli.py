"""Run ``torsh-dist`` commands in tests without a cold interpreter each time.

:func:`run_cli` runs ``torsh-dist ARGV`` as :func:`subprocess.run` would, and returns the same
:class:`subprocess.CompletedProcess`, but in a process forked from the harness's forkserver
(:mod:`torsh_distributed.testing.harness`), which imported torch and the engine once per
session. A cold ``python -m torsh_distributed.cli.main`` spends about 3.5 CPU-seconds of a 2-core
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
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from torsh_distributed.testing.harness import _context

__all__ = ["run_cli"]


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
    args = [str(a) for a in argv]
    environ = dict(os.environ if env is None else env)
    where = str(Path(cwd) if cwd is not None else Path.cwd())
    with tempfile.TemporaryDirectory(prefix="torsh-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = _context().Process(  # type: ignore[attr-defined]
            target=_command, args=(args, environ, where, str(out), str(err)), daemon=False
        )
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the command and every process it started
            proc.join(10)
            raise subprocess.TimeoutExpired(
                ["torsh-dist", *args], timeout, output=_read(out), stderr=_read(err)
            )
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of it outlives the command
        return subprocess.CompletedProcess(
            ["torsh-dist", *args], int(proc.exitcode), _read(out), _read(err)
        )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _command(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked process: become the command, run it, exit with its status."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for extra in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        sys.path.insert(0, extra)
    sys.path.insert(0, cwd)
    sys.argv = ["torsh-dist", *argv]
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
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
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    os._exit(code)
