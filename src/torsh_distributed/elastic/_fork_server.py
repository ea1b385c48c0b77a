"""Python's forkserver, started as a fork of the launcher after it imported torch.

The stdlib starts its forkserver as a fresh interpreter (``python -c 'from
multiprocessing.forkserver import main; main(...)'``) that imports the preload modules again,
torch among them: the launcher imports torch for its elastic agent, the forkserver imports it a
second time for the workers. :func:`start_forked` imports torch in the launcher first and forks
the server from it; the child then imports the rest of the preload (``torch._dynamo``, the
engine) while the launcher goes on, and serves the same stdlib protocol
(:func:`multiprocessing.forkserver.main`), so ``multiprocessing``'s forkserver context, the
workers' start and their exit codes are the stdlib's own.

What the forked server must not inherit, it drops at once, to hold what a fresh one would: every
file descriptor the launcher had open before (only the listener, the "alive" pipe and stdio stay,
as ``spawnv_passfds`` passes), the launcher's end of the alive pipe (else the server would never
see the launcher end), and the launcher's objects are frozen out of the cyclic garbage
collector (none of them can close a descriptor number the server reuses). torch is imported
before the fork, which is the state every ``DataLoader`` worker is forked in; the fork is done
only while the launcher runs no Python thread but its main one (:func:`._warm.prestart`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["start_forked"]

_PARENT_IMPORTS = ("torch", "torch.distributed")
"""What the launcher imports before the fork: what it imports next anyway (its elastic agent)."""


def _open_fds() -> set[int]:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: the usual range
        return set(range(3, 256))
    return {int(name) for name in names}


def start_forked(server: Any, preload: Sequence[str], *, in_server: Callable[[], None]) -> None:
    """Start ``server`` (the stdlib's ``multiprocessing.forkserver._forkserver``) as a fork of
    this process, preloading ``preload``; as ``ForkServer.ensure_running`` does otherwise.
    ``in_server`` runs first thing in the forked server (``_warm.become_server``)."""
    from multiprocessing import connection, resource_tracker, util

    inherited = _open_fds() - {0, 1, 2}
    for name in _PARENT_IMPORTS:
        __import__(name)
    resource_tracker.ensure_running()  # its own fresh interpreter, as the stdlib starts it
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered twice
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: "multi-threaded"
                pid = os.fork()
        except BaseException:
            os.close(alive_r)
            os.close(alive_w)
            raise
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, inherited, preload, in_server)  # no return
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def _serve(listener_fd: int, alive_r: int, alive_w: int, inherited: set[int],
           preload: Sequence[str], in_server: Callable[[], None]) -> None:
    code = 0
    try:
        gc.freeze()  # the launcher's objects stay as they are: none is collected here
        for fd in (inherited | {alive_w}) - {listener_fd, alive_r}:
            with contextlib.suppress(OSError):
                os.close(fd)
        from multiprocessing import forkserver

        in_server()
        forkserver.main(listener_fd, alive_r, list(preload))
    except SystemExit as exc:  # the end of the launcher and its workers (EOF on the alive pipe)
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:  # noqa: BLE001 - said on stderr; the launcher sees the server gone
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)  # never the launcher's exit handlers, nor the interpreter's teardown
