"""A SuperNode whose ClientApps start warm: each Flower message still gets its own
``flwr-clientapp`` process, forked from a process that imported torch and Flower once.

How Flower 1.42 runs ClientApps in its default ``--isolation subprocess`` mode: ``flower-supernode``
starts one ``flower-superexec`` (``supernode/start_client_internal.py:207-222``) and creates a
task for **every message** it pulls from the SuperLink (``:388``); the SuperExec polls the
SuperNode's Runtime API for tasks (``supercore/superexec/run_superexec.py:256``, every
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` s, 1 s by default) and launches each with its
``Executor``; the only local one, ``SubprocessExecutor``, ``Popen``s a fresh ``flwr-clientapp``
interpreter (``executor/subprocess_executor.py:76-83``), which pulls its one message, runs the
ClientApp and exits (``supernode/runtime/run_clientapp.py:151-231``). So every train, evaluate
and SecAgg+ stage message pays a new interpreter importing Flower, torch and the app: about 3 CPU
seconds on a 2-core VM (docs/benchmarks.md, "Warm ClientApps"). Flower's warm executor pools
serve only AgentApp, model and connector tasks, on Kubernetes
(``executor/warm_executor_pool.py:33-35``, ``executor/factory.py:60-87``).

Here the SuperNode runs with ``--isolation process`` (it starts no SuperExec; the mode meant
for a SuperExec run by someone else) and this process is that SuperExec: Flower's own
``run_superexec`` loop against the SuperNode's Runtime API, with :class:`ForkserverExecutor`
(Flower's ``Executor`` protocol) in place of ``SubprocessExecutor``. It forks every
``flwr-clientapp`` from Python's forkserver, preloaded with torch, Flower's ClientApp runtime and
the engine's ClientApps, then runs Flower's own ``flwr_clientapp()`` main with the command line
``SubprocessExecutor`` would have given it. What stays as it was:

* **One process per message**, forked from a server that only imported modules: nothing of one
  message's process reaches the next (module state starts as after a fresh import). A SIGKILLed
  ClientApp is a dead client, and killing the SuperNode's process tree kills all of it.
* **Flower's protocol and components**: the SuperLink, SuperNode, Runtime API, task tokens,
  heartbeats and ``flwr-clientapp``'s code are Flower's; only who starts the process changed.
* **Your own ClientApp**: Flower loads it from the run's FAB in the forked process as before;
  it finds torch and Flower already imported, its own modules are imported there afresh.
* Its name in ``ps``: ``python .../flwr-clientapp --runtime-api-address ... --token ...`` as a
  spawned one (:func:`~torsh_distributed.elastic._warm.set_title`).

Other task types (none reach a SuperNode today) go to Flower's ``SubprocessExecutor``.

    python -m torsh_distributed.federated._warm_node --runtime-api-address 127.0.0.1:PORT \\
        -- flower-supernode --isolation process --port PORT ...

returns the SuperNode's exit code. This module imports neither torch nor Flower at import: the
forkserver starts first and imports while Flower's SuperExec is being imported here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torsh_distributed.elastic import _warm
from torsh_distributed.federated._flower_polls import (
    SERVERAPP_SITE,
    poll_from_env,
    shorten_idle_polls,
)

__all__ = ["PRELOAD", "ForkserverExecutor", "NodeOutput", "main", "serve_clientapps"]

PRELOAD = (
    *_warm.preload_for(None),  # this helper module first, torch, torch._dynamo
    "flwr.supernode.cli.flwr_clientapp",  # Flower's ClientApp process: its HTTP client, serde, FAB install
    "flwr.superlink.cli.flwr_serverapp",  # Flower's ServerApp process (a Federation's SuperLinks)
    "torsh_distributed.federated._warm_node",  # the forked process's entry point
    "torsh_distributed.federated.apps",  # the engine's ClientApps (found in sys.modules by Flower's loader)
    "torsh_distributed.federated.secagg",
    "torsh_distributed.federated.client",
    "torsh_distributed.federated.server",  # what the engine's ServerApp runs
    "torsh_distributed.engine.engine",  # what a train message runs
    "torsh_distributed.runtime._gc_freeze",  # last: a ClientApp's collections skip all of the above
)
"""What the forkserver imports once (per federation for its local SuperNodes and its SuperLinks'
ServerApps, else per SuperNode), for every ClientApp and ServerApp process forked from it."""

_CLIENTAPP = "flwr-clientapp"
_SERVERAPP = "flwr-serverapp"
_WARM_TASKS = {
    _CLIENTAPP: "flwr.supernode.cli.flwr_clientapp:flwr_clientapp",
    _SERVERAPP: "flwr.superlink.cli.flwr_serverapp:flwr_serverapp",
}
"""The apps forked warm: Flower's command -> its main (``module:function``)."""
_log = logging.getLogger(__name__)


def _app_argv(spec: Any) -> list[str]:
    """The app's command line for ``spec`` (an ``ExecutionSpec``: ``flwr-clientapp ...`` or
    ``flwr-serverapp ...``), as Flower's ``SubprocessExecutor.launch`` builds it."""
    from flwr.supercore.constant import TASK_TYPE_TO_APPIO_API_ADDRESS_ARG, TASK_TYPE_TO_COMMAND

    command = TASK_TYPE_TO_COMMAND[spec.task_type]
    script = Path(sys.executable).parent / command
    args = [str(script) if script.exists() else command,
            TASK_TYPE_TO_APPIO_API_ADDRESS_ARG[spec.task_type], spec.runtime_api_address, "--token", spec.token]  # fmt: skip
    if spec.insecure:
        args.append("--insecure")
    elif spec.root_certificates_path is not None:
        args += ["--root-certificates", spec.root_certificates_path]
    if spec.parent_pid is not None:
        args += ["--parent-pid", str(spec.parent_pid)]
    if spec.runtime_dependency_install:
        args.append("--allow-runtime-dependency-installation")
    return args


class NodeOutput:
    """The launching node's stdout and stderr, for a ClientApp forked from a forkserver that the
    federation's local nodes share: passed as an argument of the process, its descriptors go
    with the fork request (``multiprocessing.reduction.DupFd``) and become the ClientApp's
    standard output and error when it is unpickled, so each ClientApp writes to its own node's
    log, as one that its node started does."""

    def __reduce__(self) -> tuple[Any, tuple[Any, Any]]:
        from multiprocessing.reduction import DupFd

        return _adopt_output, (DupFd(1), DupFd(2))


def _adopt_output(out: Any, err: Any) -> None:
    for fd, target in ((out.detach(), 1), (err.detach(), 2)):
        os.dup2(fd, target)
        os.close(fd)


def run_app(argv: list[str], quiet: bool, output: NodeOutput | None = None) -> None:
    """In a process forked from the forkserver: ``flwr-clientapp ARGV[1:]`` or ``flwr-serverapp
    ARGV[1:]`` (Flower's main; it exits through ``SystemExit`` with Flower's exit code).
    ``output``: already this process's stdout and stderr (:class:`NodeOutput`, applied when the
    arguments were unpickled)."""
    del output
    # the title first: setproctitle moves the environment block, which must still be the original
    _warm.set_title([sys.executable, *argv])
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    _warm.line_buffered_output()
    sys.argv = list(argv)  # argparse and Flower's exit telemetry read it
    command = Path(argv[0]).name
    module, _, function = _WARM_TASKS[command].partition(":")
    main = getattr(importlib.import_module(module), function)
    if command == _SERVERAPP:
        shorten_idle_polls(poll_from_env(), (SERVERAPP_SITE,))  # its wait for a round's replies
    with _warm.exit_handlers_at_end():  # a user's app's final flush
        main()


class ForkserverExecutor:
    """Flower's SuperExec ``Executor``: ``flwr-clientapp`` and ``flwr-serverapp`` processes
    forked from the forkserver (:data:`PRELOAD`); other task types through Flower's
    ``SubprocessExecutor``.

    Like ``SubprocessExecutor`` it has no capacity gate. It keeps the processes it started so
    that :meth:`reconcile` reaps them (a ClientApp that died of a signal is logged) and
    :meth:`close` stops those still running as Flower's own ClientApps stop when their SuperExec
    is gone (SIGINT, then SIGKILL after ``grace_s``).
    """

    def __init__(self, *, grace_s: float = 10.0) -> None:
        import multiprocessing

        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self._context = multiprocessing.get_context("forkserver")
        self._cold = SubprocessExecutor()
        self._procs: list[Any] = []
        self._grace_s = grace_s

    def get_eligible_capacity(
        self,
        supported_task_types: set[Any],
        *,
        insecure: bool = False,
        root_certificates_path: str | None = None,
    ) -> tuple[set[Any], set[str]]:
        del insecure, root_certificates_path
        return set(supported_task_types), set()

    def wait_for_capacity(self, task_type: Any = None, **_: Any) -> None:
        del task_type

    def launch(self, spec: Any) -> Any:
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor import LaunchResult

        if spec.task_type not in (TaskType.CLIENT_APP, TaskType.SERVER_APP):
            return self._cold.launch(spec)
        argv = _app_argv(spec)
        command = Path(argv[0]).name
        proc = self._context.Process(
            target=run_app, args=(argv, bool(spec.suppress_output), NodeOutput()), name=f"{command}-{spec.task_id}",
        )  # fmt: skip
        try:
            proc.start()
        except OSError as err:  # the forkserver is gone: Flower's task expiry applies
            return LaunchResult.failed(f"could not fork {command} from the forkserver: {err}")
        self._procs.append(proc)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        running = []
        for proc in self._procs:
            if proc.exitcode is None:
                running.append(proc)
                continue
            if proc.exitcode < 0:
                _log.warning("%s (pid %d) ended by signal %d", proc.name, proc.pid, -proc.exitcode)
            proc.close()
        self._procs = running

    def close(self) -> None:
        live = [p for p in self._procs if p.exitcode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)  # what their parent monitor does (app_utils.py)
        deadline = time.monotonic() + self._grace_s
        for proc in live:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self._procs = []
        self._cold.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_listening(address: str, exited: Callable[[], int | None], *, timeout: float) -> None:
    """Until the SuperNode's Runtime API (or the SuperLink's ServerAppIo API) accepts
    connections (Flower starts its own SuperExec only after that, ``flower_supernode.py``);
    ``exited()``: the exit code of the process serving it, None while it runs."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (code := exited()) is not None:
            raise SystemExit(code)
        with (
            contextlib.suppress(OSError),
            socket.create_connection((host.strip("[]"), int(port)), timeout=0.5),
        ):
            return
        time.sleep(0.1)
    raise TimeoutError(
        f"flower-supernode's Runtime API did not listen on {address} within {timeout:.0f} s"
    )


def _run_superexec(address: str, *, parent_pid: int) -> None:
    """Flower's SuperExec loop (``run_superexec``) with :class:`ForkserverExecutor`.

    Flower 1.42 chooses the executor by name only (``get_executor``: ``subprocess`` or
    ``kubernetes``, ``executor/factory.py:53``); this process is a SuperExec of its own, so the
    lookup is replaced here, in this process only.
    """
    from flwr.supercore.superexec import run_superexec as superexec

    if not hasattr(superexec, "get_executor"):
        raise RuntimeError(
            "this Flower's run_superexec has no get_executor to choose the executor; start the "
            "SuperNodes with --start-method spawn (Flower's own SuperExec)"
        )
    executor = ForkserverExecutor()
    superexec.get_executor = lambda *_, **__: executor  # type: ignore[attr-defined]
    superexec.run_superexec(runtime_api_address=address, insecure=True, parent_pid=parent_pid)


def serve_clientapps(listener_fd: int) -> None:
    """Be the forkserver of every local SuperNode of a federation (``--serve-clientapps FD``):
    Python's forkserver loop (:func:`multiprocessing.forkserver.main`) on the listening socket
    ``FD``, :data:`PRELOAD` imported once for all of them. It runs until it is stopped (the
    federation stops it with its nodes; the ClientApps it forked share its session)."""
    from multiprocessing import forkserver

    alive_r, _alive_w = os.pipe()  # held here: the server does not end when a node does
    try:
        forkserver.main(listener_fd, alive_r, list(PRELOAD))
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(0)  # no teardown of torch's objects: nothing of this process outlives it


def _adopt_server(address: str) -> None:
    """Fork this node's ClientApps from the federation's shared forkserver at ``address``
    (:func:`serve_clientapps`) instead of starting one of its own. The stdlib's client side
    is used as it is; it sends each new process an "alive" descriptor, here the write end of a
    pipe of this node's (the shared server's lifetime is the federation's, not this node's)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - the stdlib's one forkserver per process
    read_end, alive_w = os.pipe()
    os.close(read_end)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server.ensure_running = lambda: None  # run (and stopped) by the federation, not by us


def main(argv: list[str] | None = None) -> int:
    """Start the forkserver (or use the federation's), the SuperNode (``argv`` after ``--``)
    and the SuperExec loop; returns the SuperNode's exit code. ``--serve-clientapps FD``: be a
    federation's shared forkserver instead (:func:`serve_clientapps`). ``--superlink-pid PID``:
    only the SuperExec loop, for the ServerApps of a SuperLink started with ``--isolation
    process`` (:meth:`~torsh_distributed.federated.deploy.Federation.start_superlink`)."""
    from torsh_distributed.federated.deploy import _die_with_parent
    from torsh_distributed.runtime.busy import scaled_start_timeout

    parser = argparse.ArgumentParser(prog="python -m torsh_distributed.federated._warm_node")
    parser.add_argument("--runtime-api-address", help="the SuperNode's --host:--port")
    parser.add_argument(
        "--clientapp-server",
        metavar="ADDRESS",
        help="fork ClientApps from this shared forkserver (Federation's)",
    )
    parser.add_argument(
        "--serve-clientapps",
        type=int,
        metavar="FD",
        help="be the shared forkserver, listening on the socket FD",
    )
    parser.add_argument(
        "--superlink-pid",
        type=int,
        metavar="PID",
        help="no SuperNode: be the SuperExec of this SuperLink's ServerApps "
        "(--runtime-api-address: its --serverappio-api-address)",
    )
    parser.add_argument("supernode", nargs=argparse.REMAINDER, help="-- flower-supernode ARGS...")
    args = parser.parse_args(argv)
    if args.serve_clientapps is not None:
        serve_clientapps(args.serve_clientapps)
    command = args.supernode[1:] if args.supernode[:1] == ["--"] else args.supernode
    if not args.runtime_api_address or (not command and args.superlink_pid is None):
        parser.error(
            "give --runtime-api-address and the flower-supernode command after -- (or --superlink-pid)"
        )
    if args.clientapp_server:
        _adopt_server(args.clientapp_server)
    else:
        _warm.prestart(PRELOAD)  # imports in the background from here on
    timeout = scaled_start_timeout(60)
    if args.superlink_pid is not None:
        link = args.superlink_pid
        with contextlib.suppress(SystemExit, KeyboardInterrupt):  # the SuperLink ended, or Ctrl-C
            _wait_listening(
                args.runtime_api_address, lambda: None if _pid_alive(link) else 1, timeout=timeout
            )
            _run_superexec(args.runtime_api_address, parent_pid=link)
        return 0
    node = subprocess.Popen(command, preexec_fn=_die_with_parent)
    try:
        _wait_listening(args.runtime_api_address, node.poll, timeout=timeout)
        _run_superexec(args.runtime_api_address, parent_pid=node.pid)
    except (SystemExit, KeyboardInterrupt):
        pass  # Flower's exit after a signal or when the SuperNode is gone; Ctrl-C before that
    finally:
        if node.poll() is None:
            node.terminate()
            try:
                node.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.kill()
    return node.wait()


if __name__ == "__main__":
    sys.exit(main())
