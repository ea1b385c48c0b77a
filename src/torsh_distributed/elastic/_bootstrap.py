"""Run one worker's script or module as ``__main__`` and record its failure for the launcher.

``torsh-dist run`` starts every worker as one of::

    python -u -m torsh_distributed.elastic._bootstrap SCRIPT.py ARGS...
    python -u -m torsh_distributed.elastic._bootstrap -m PACKAGE.MODULE ARGS...

The target runs through :mod:`runpy` as ``python SCRIPT.py`` / ``python -m MODULE`` would run it:
``__name__ == "__main__"``, ``sys.argv == [SCRIPT.py, *ARGS]`` (``sys.argv[0]`` the module's file
for ``-m``) and ``sys.path[0]`` the script's directory (the working directory for ``-m``).

An uncaught exception is written as JSON to ``TORCHELASTIC_ERROR_FILE``, in the format of torch's
``torch.distributed.elastic.multiprocessing.errors.ErrorHandler`` (so the agent reads it into
``ChildFailedError.failures``), plus a ``"torsh"`` section with the rank, host and a nanosecond
timestamp that the launcher uses to find the rank that failed first. The worker then exits with
code 1 **without printing the traceback**: the launcher prints it once, for the root-cause rank,
instead of one copy per rank. When a restart will follow (``TORCHELASTIC_RESTART_COUNT <
TORCHELASTIC_MAX_RESTARTS``) the worker prints a single line naming the exception, because no
final report will show that attempt. Without ``TORCHELASTIC_ERROR_FILE`` (started by hand) or when
the file cannot be written, the traceback is printed as usual: nobody else would show it.

``SystemExit`` keeps its meaning (``sys.exit(3)`` exits with 3 and records nothing: there is no
traceback to show). ``KeyboardInterrupt`` exits with 130 quietly: on Ctrl-C every rank gets the
signal and the launcher reports the interruption once.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import socket
import sys
import time
import traceback
from types import TracebackType

__all__ = ["main", "error_record", "run_worker"]

USAGE = "usage: python -m torsh_distributed.elastic._bootstrap (SCRIPT | -m MODULE) [ARGS ...]"
_RUNPY_FILE = os.path.normcase(os.path.abspath(runpy.__file__))


def _is_wrapper_frame(filename: str) -> bool:
    """Frames of this module and of runpy: noise above the user's first frame."""
    if filename.startswith("<frozen runpy"):
        return True
    path = os.path.normcase(os.path.abspath(filename))
    return path in (_RUNPY_FILE, os.path.normcase(os.path.abspath(__file__)))


def _user_traceback(exc: BaseException) -> str:
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and _is_wrapper_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    if tb is None:
        # Raised by runpy itself (no such script or module): its internal chain is noise.
        return "".join(traceback.format_exception_only(type(exc), exc))
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def error_record(exc: BaseException) -> dict[str, object]:
    """The error-file JSON for ``exc``: torch's ``ErrorHandler`` layout plus a ``torsh`` section."""
    summary = f"{type(exc).__name__}: {exc}"
    now_ns = time.time_ns()
    return {
        "message": {
            "message": summary,
            "extraInfo": {
                "py_callstack": _user_traceback(exc),
                "timestamp": str(now_ns // 1_000_000_000),
            },
        },
        "torsh": {
            "summary": summary,
            "exception": type(exc).__name__,
            "time_ns": now_ns,
            "rank": _env_int("RANK"),
            "local_rank": _env_int("LOCAL_RANK"),
            "group_rank": _env_int("GROUP_RANK"),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        },
    }


def _record(exc: BaseException) -> bool:
    """Write the error file; False when there is none to write (the caller prints instead)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    tmp = f"{path}.{os.getpid()}.tmp"
    try:  # whole or not at all: the launcher may stop this worker while it writes
        with open(tmp, "w", encoding="utf-8") as fp:
            json.dump(error_record(exc), fp)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def _announce_restart(exc: BaseException) -> None:
    attempt, max_restarts = (
        _env_int("TORCHELASTIC_RESTART_COUNT"),
        _env_int("TORCHELASTIC_MAX_RESTARTS"),
    )
    if attempt is None or max_restarts is None or attempt >= max_restarts:
        return  # the last attempt: the launcher's final report shows the traceback
    first_line = (str(exc).splitlines() or [""])[0]
    print(
        f"{type(exc).__name__}: {first_line} "
        f"(attempt {attempt + 1} of {max_restarts + 1} failed; the launcher restarts all workers)",
        file=sys.stderr,
        flush=True,
    )


def _run(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]  # run_module replaces argv[0] with the module's file
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise SystemExit(USAGE)
    script, rest = argv[0], argv[1:]
    sys.argv = [script, *rest]
    if not sys.flags.safe_path and sys.path:
        # `python -m this` put the working directory first; `python script.py` puts the script's.
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    """Run the target; return the process exit code (``SystemExit`` passes through)."""
    faulthandler.enable(all_threads=True)  # a segfault still leaves Python stacks on stderr
    try:
        _run(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure must reach the launcher
        if _record(exc):
            _announce_restart(exc)
        else:
            sys.stderr.write(_user_traceback(exc))
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return 0


def run_worker(launcher_env: dict[str, str], cwd: str, argv: list[str]) -> None:
    """A worker forked from the launcher's forkserver (``start_method="forkserver"``, see
    :mod:`torsh_distributed.elastic._warm`): the same as ``python -u -m`` this module ``ARGV``
    started in ``cwd`` with ``launcher_env``. A non-zero exit code leaves as ``SystemExit``."""
    from torsh_distributed.elastic import _warm

    # the title first: setproctitle moves the environment block, which must still be the original
    _warm.set_title([sys.executable, "-u", "-m", __name__.rpartition(".")[0] + "._bootstrap", *argv])
    _warm.adopt_environment(launcher_env)
    os.chdir(cwd)
    _warm.line_buffered_output()
    if argv and argv[0] == "-m" and not sys.flags.safe_path and sys.path:
        sys.path[0] = cwd  # `python -m` puts the working directory first
    with _warm.exit_handlers_at_end():  # the script's, e.g. a tracker's final flush
        code = main(argv)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    sys.exit(main())
