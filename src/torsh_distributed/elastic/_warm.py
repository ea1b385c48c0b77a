"""Warm worker start: every worker of a launch forks from one process that imported torch once.

``torsh-dist run`` / ``train`` used to start each worker as a fresh interpreter
(``python -u -m torsh_distributed.elastic._bootstrap ...``), and every one of them imported torch,
``torch._dynamo`` (the first ``torch.optim`` optimizer imports it) and, for ``train``, the engine:
about 3.5 CPU seconds per worker on the 2-core VM this was measured on, paid again at every
elastic restart. With ``start_method="forkserver"`` (the default) the launcher starts Python's
forkserver early, preloaded with those modules, while it does its own work (argument checks,
rendezvous); workers are then forked from it, already past the imports. See docs/multihost.md
("How workers start") for the measured difference and ``--start-method spawn`` for the old way.

What a forked worker sees must equal what a fresh one would:

* **Environment.** The forkserver's environment is the launcher's at the time it started; the
  launcher may set more before the workers start (``OMP_NUM_THREADS``, ``GLOO_SOCKET_IFNAME``,
  the job id, the user's ``env``). The launcher passes its environment at launch time and the
  worker adopts it, keeping on top what torch's agent set for this rank (``RANK``,
  ``TORCHELASTIC_ERROR_FILE``, ...): ``{**launcher_env, **agent_env}``, as a subprocess gets.
  The agent's variables are told apart from the forkserver's own by :data:`BASE_ENV`, captured
  when this module is imported in the forkserver (it is the first module preloaded).
* **Working directory and ``sys.path``**: set as ``python SCRIPT`` / ``python -m MODULE`` would.
* **Its name in ``ps``**: the command line a spawned worker would have (``python -u -m
  torsh_distributed.elastic._bootstrap ...``), so ``pgrep -f train.py`` still finds the ranks;
  written with ``setproctitle`` (a dependency), else only the 15-character thread name is set.
* **Unbuffered output** (``python -u``): stdout and stderr are line-buffered with write-through.

This module imports nothing heavy: the launcher calls :func:`prestart` before it imports torch.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence

__all__ = [
    "BASE_ENV", "START_METHODS", "adopt_environment", "allow_fork", "become_server",
    "check_start_method", "exit_handlers_at_end", "line_buffered_output", "prestart", "preload_for", "set_title",
]

START_METHODS = ("forkserver", "spawn")
"""``forkserver``: workers fork from a process that preloaded torch (the default). ``spawn``: one
fresh interpreter per worker (``python -u -m ...``), as torchrun starts a script."""


def check_start_method(value: str) -> None:
    """Raise ``ValueError`` naming the choices unless ``value`` is one of :data:`START_METHODS`."""
    if value not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {value!r}")


def line_buffered_output() -> None:
    """In a forked process: stdout and stderr line by line with write-through, as a fresh
    ``python -u`` process's (streams that cannot be reconfigured are left alone)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]


@contextlib.contextmanager
def exit_handlers_at_end() -> Iterator[None]:
    """In a forked process: run the ``atexit`` handlers when the body ends, however it ends, as a
    fresh interpreter does at its end (a forked process leaves through ``os._exit``, which skips
    them: a user's or a tracker's final flush would be lost)."""
    try:
        yield
    finally:
        atexit._run_exitfuncs()


BASE_ENV: dict[str, str] = dict(os.environ)
"""The environment of the process that imported this module first: in a worker forked from the
forkserver, the forkserver's (this module is preloaded there)."""
_BASE_PID = os.getpid()


def _in_forkserver() -> bool:
    """Whether this process is Python's forkserver itself (this module imported as its preload),
    not a process forked from it (whose ``sys.argv`` multiprocessing sets to its parent's, and
    whose ``parent_process()`` is set)."""
    if sys.argv[:1] != ["-c"] or "multiprocessing.forkserver" not in sys.modules:
        return False
    import multiprocessing

    return multiprocessing.parent_process() is None


def _exit_now() -> None:
    """The forkserver's last ``atexit`` handler: end without the interpreter's teardown."""
    if os.getpid() != _BASE_PID:  # a forked worker that runs its atexit handlers: not here
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if _in_forkserver():
    # The forkserver ends when the launcher does (end of its input). With torch and dynamo
    # imported, the interpreter's teardown took 0.8-1.1 s on the 2-core VM, and the forkserver
    # holds the launcher's stdout and stderr until it is gone: a shell pipe or a caller reading
    # the command's output waited that long after the launcher had exited. It owns no files, so
    # it ends at once (registered first, this handler runs after every other one).
    atexit.register(_exit_now)

# _omp_wait before torch: OpenMP's idle threads sleep (read once, when torch loads OpenMP)
_PRELOAD = ("torsh_distributed.elastic._warm", "torsh_distributed.runtime._omp_wait", "torch", "torch._dynamo")
# What `torsh-dist train`'s workers import besides: the engine and the trainer (~0.5 s more).
_TRAIN_PRELOAD = ("torsh_distributed.engine.engine", "torsh_distributed.train.trainer")
# What the ranks of fault-tolerant replica groups (torsh_distributed.ft.launch) import besides.
_FT_PRELOAD = ("torchft", "torsh_distributed.ft.replica")
# Last: freezes what the preload created, so a worker's garbage collections skip it.
_GC_FREEZE = "torsh_distributed.runtime._gc_freeze"


def preload_for(module: str | None, *, ft: bool = False) -> list[str]:
    """The modules the forkserver imports for a launch of ``module`` (``None``: a script);
    ``ft``: the ranks run in replica groups (torchft)."""
    extra = _TRAIN_PRELOAD if module and module.startswith("torsh_distributed.") else ()
    return [*_PRELOAD, *extra, *(_FT_PRELOAD if ft else ()), _GC_FREEZE]


def prestart(preload: Sequence[str], *, fork: bool = False) -> bool:
    """Start Python's forkserver now, importing ``preload``, unless it already runs (then its
    preload stays what it was). Returns True when this call started it. Does not wait for the
    imports: they run in the forkserver while the caller goes on.

    ``fork``: start the forkserver as a fork of this process right after importing torch here
    (which a launcher imports next anyway), instead of as a fresh interpreter that imports torch
    again: torch is imported once for the launcher and all its workers, about 1.4 CPU seconds
    less per launch on the 2-core VM (docs/benchmarks.md, "The forkserver forked from the
    command"). Only for a process that
    holds nothing its workers must not inherit: the ``torsh-dist`` command before it launches
    (:func:`allow_fork`). Anywhere else, where this process runs a Python thread besides the main
    one, or on a platform without ``fork``, the fresh interpreter is started instead
    (``TORSH_WARM_FORK=0`` asks for it too)."""
    import multiprocessing
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - the stdlib's one forkserver per process
    if getattr(server, "_forkserver_pid", None) is not None:
        return False
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    if fork and _may_fork():
        from torsh_distributed.elastic._fork_server import start_forked

        start_forked(server, list(preload), in_server=become_server)
    else:
        forkserver.ensure_running()
    return True


_FORK_ALLOWED = False


def allow_fork() -> None:
    """Called by the ``torsh-dist`` console script (and ``python -m torsh_distributed.cli.main``)
    first: this process is the command, so ``prestart(fork=True)`` may fork it. Where the CLI's
    ``main()`` is called from someone else's process (a notebook, a test), it holds their state
    (open files, captured output, handlers) and the fresh interpreter is started instead."""
    global _FORK_ALLOWED
    _FORK_ALLOWED = True


def _may_fork() -> bool:
    import threading

    return (
        _FORK_ALLOWED
        and hasattr(os, "fork")
        and os.environ.get("TORSH_WARM_FORK", "1") != "0"
        and threading.active_count() == 1
    )


def become_server() -> None:
    """In the forked forkserver: this process's environment and pid are the base its workers
    are told apart from (:data:`BASE_ENV`), as in a forkserver that imported this module first."""
    global BASE_ENV, _BASE_PID
    BASE_ENV = dict(os.environ)
    _BASE_PID = os.getpid()


def adopt_environment(launcher_env: Mapping[str, str]) -> None:
    """In a forked worker: make ``os.environ`` the launcher's environment at launch time plus
    what the agent set for this worker (the variables that differ from the forkserver's)."""
    if os.getpid() == _BASE_PID:
        # not preloaded in a forkserver (imported here first): the agent's variables cannot be
        # told apart, so only add what is missing
        for key, value in launcher_env.items():
            os.environ.setdefault(key, value)
        return
    agent = {k: v for k, v in os.environ.items() if BASE_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(agent)


def set_title(argv: Sequence[str]) -> None:
    """Show ``argv`` as this process's command line (``/proc/PID/cmdline``, ``ps``)."""
    title = " ".join(argv)
    try:
        import setproctitle
    except ImportError:
        setproctitle = None
    if setproctitle is not None:
        setproctitle.setproctitle(title)
        return
    try:  # without it: the kernel's 15-byte name (ps -o comm, top, pgrep without -f)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, b"torsh-worker", 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
