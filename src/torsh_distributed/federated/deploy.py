"""Starting a federation on Flower's deployment engine: a SuperLink, SuperNodes, the submitted run.

:class:`Federation` starts ``flower-superlink`` (bound to 127.0.0.1 unless told otherwise), one
``flower-supernode`` per client (local mode: all on this host; remote mode: they are started on
their hosts by ``torsh-dist federated-node``), writes a minimal Flower app whose components are
:mod:`torsh_distributed.federated.apps`, submits it with ``flwr run`` (``FLWR_HOME`` in the run
directory, so the user's own Flower configuration is untouched) and streams the ServerApp's lines
until the run ends. Every process logs to ``run_dir/logs/``; all are stopped on exit, also on
error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from torsh_distributed.elastic._warm import check_start_method
from torsh_distributed.federated._flower_polls import (
    DEFAULT_POLL_S,
    POLL_ENV,
    SUPEREXEC_POLL_ENV,
    check_poll,
)
from torsh_distributed.federated._relay import Relay
from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.runtime._net import free_port
from torsh_distributed.runtime.busy import scaled_start_timeout
from torsh_distributed.runtime.tls import TLSFiles

__all__ = ["Federation", "free_port", "join", "supernode_command"]

_APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "torsh-federated"
version = "1.0.0"
description = "torsh-dist federated run (components in the installed torsh_distributed)"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "torsh-distributed"

[tool.flwr.app.components]
serverapp = "torsh_distributed.federated.apps:server_app"
clientapp = "torsh_distributed.federated.apps:client_app"

[tool.flwr.app.config]
spec = ""
"""


_RUN_ID = re.compile(r"run_id `(\d+)`")
_CLIENT_COMPONENT = 'clientapp = "torsh_distributed.federated.apps:client_app"'
_SECAGG_CLIENT_COMPONENT = 'clientapp = "torsh_distributed.federated.secagg:secagg_client_app"'


def _bin(name: str) -> str:
    """A console script of the running environment (Flower's live next to our Python)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _env(home: Path | None = None, *, poll_s: float = DEFAULT_POLL_S) -> dict[str, str]:
    env = dict(os.environ)
    # how long Flower's idle SuperNodes, ServerApps and SuperExecs sleep between polls (_flower_polls)
    env[POLL_ENV] = repr(float(poll_s))
    env.setdefault(SUPEREXEC_POLL_ENV, repr(float(poll_s)))
    if home is not None:  # Flower's apps, runtime envs and CLI config stay in the run directory
        env["FLWR_HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def supernode_command(
    superlink: str, *, partition_id: int, num_partitions: int, host: str = "127.0.0.1", port: int,
    start_method: str = "forkserver", clientapp_server: str | None = None,
) -> list[str]:
    """The command line of client ``partition_id``'s SuperNode (``--node-config`` comes last):
    Flower's ``flower-supernode``, started through
    :mod:`~torsh_distributed.federated._flower_polls` so that it idle-polls every
    ``TORSH_FLOWER_POLL_S`` s of its environment (:func:`_env`) instead of Flower's 3 s.

    Args:
        start_method: How its ClientApps start, one process per Flower message either way.
            ``forkserver``: forked from a process that imported torch, Flower and the engine once
            (:mod:`~torsh_distributed.federated._warm_node`; ~3 CPU seconds less per message, one
            more resident process per node). ``spawn``: Flower's own SuperExec starts a fresh
            ``flwr-clientapp`` interpreter per message.
        clientapp_server: ``forkserver`` only: the address of a forkserver shared by the
            federation's local nodes (:meth:`Federation.running` starts it), instead of one per node.

    Raises:
        ValueError: an unknown ``start_method``.
    """
    check_start_method(start_method)
    node = [
        sys.executable, "-m", "torsh_distributed.federated._flower_polls",  # Flower's, polling faster
        _bin("flower-supernode"), "--insecure", "--superlink", superlink,
        "--host", host, "--port", str(port),
        "--node-config", f"partition-id={partition_id} num-partitions={num_partitions}",
    ]  # fmt: skip
    if start_method == "spawn":
        return node
    runtime = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    node[4:4] = ["--isolation", "process"]  # this node's SuperExec is _warm_node
    shared = ["--clientapp-server", clientapp_server] if clientapp_server else []
    return [sys.executable, "-m", "torsh_distributed.federated._warm_node", "--runtime-api-address", runtime,
            *shared, "--", *node]  # fmt: skip


def _kill_apps(ports: set[int]) -> None:
    """SIGKILL Flower's ``flwr-serverapp``/``flwr-clientapp``/``flower-superexec`` processes
    attached to our SuperLinks/SuperNodes (``--runtime-api-address 127.0.0.1:PORT`` or its
    ``--parent-pid``): they run detached, so stopping their parents does not reach them."""
    if not ports:
        return
    import psutil

    targets = {f"127.0.0.1:{p}" for p in ports}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if not any(("flwr-serverapp" in c or "flwr-clientapp" in c or "flower-superexec" in c) for c in cmd[:2]):
            continue
        if any(c in targets for c in cmd):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM this process when the launcher dies (Linux), so a killed
    launcher leaves no SuperLink or SuperNode polling forever."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def join(
    superlink: str, *, partition_id: int, num_partitions: int, token: str = "", host: str = "127.0.0.1",
    port: int = 0, tls: TLSFiles | None = None, insecure: bool = False, start_method: str = "forkserver",
    poll_s: float = DEFAULT_POLL_S,
) -> int:
    """Run client ``partition_id``'s SuperNode until it exits; returns its exit code.

    With a ``token`` (required when ``superlink`` is not on loopback) a client relay on this
    host's loopback proves the token to the head's relay and carries the SuperNode's traffic;
    over TLS (``tls``: the federation's CA, this node's certificate and key) unless ``insecure``.
    ``start_method``: how its ClientApps start (:func:`supernode_command`). ``poll_s``: how
    often the idle SuperNode asks for a message (and its SuperExec for a ClientApp to start),
    in (0, 3] s; 3 is Flower's own (:mod:`~torsh_distributed.federated._flower_polls`).

    Raises:
        ValueError: a malformed address, a remote head without a token, or without TLS and
            ``insecure``, a bad partition id, a ``poll_s`` outside (0, 3].
    """
    check_poll(poll_s, name="poll_s (--poll)")
    head, sep, head_port = superlink.rpartition(":")
    if not sep or not head or not head_port.isdigit():
        raise ValueError(f"--superlink must be HOST:PORT, got {superlink!r}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"--partition-id {partition_id} is not in [0, {num_partitions})")
    relay = None
    if token and tls is None and not insecure:
        raise ValueError(
            f"joining {superlink} without TLS would carry weights and updates in the clear: give the "
            "federation's --tls-ca and this node's --tls-cert/--tls-key, or --insecure to accept that"
        )
    if token:
        relay = Relay(role="client", listen=("127.0.0.1", 0), target=(head, int(head_port)), token=token.encode(),
                      tls=tls.client() if tls is not None else None)  # fmt: skip
        superlink = f"127.0.0.1:{relay.start().port}"
    elif not _is_loopback(head):
        raise ValueError(
            f"joining {superlink} needs the federation's token (--token-env VAR or --token-file FILE)"
        )
    cmd = supernode_command(
        superlink, partition_id=partition_id, num_partitions=num_partitions, host=host,
        port=port or free_port(host), start_method=start_method,
    )  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(poll_s=poll_s), preexec_fn=_die_with_parent)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()
    finally:
        if relay is not None:
            relay.stop()


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], *, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting (see its log)")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not listen on {host}:{port} within {timeout:.0f} s")


@dataclass(slots=True)
class Federation:
    """A local federation: SuperLink, ``config.clients`` SuperNodes, one submitted run.

    The SuperLink itself always listens on 127.0.0.1; with a ``host`` other than loopback a
    token-checking relay (:mod:`~torsh_distributed.federated._relay`) listens there instead, so
    nothing without the token reaches Flower's Fleet or Control API.

    Args:
        config: The run (its ``run_dir`` receives the spec, logs, checkpoints and summary).
        host: Address the federation is reachable on (127.0.0.1 = this machine only).
        port: Its port (0 = a free one).
        token: Shared secret that remote nodes must prove (required when ``host`` is not
            loopback; at least 16 characters).
        local_nodes: Start the SuperNodes here (False: they join from their hosts).
        echo: Receives the ServerApp's progress lines.
        tls: The relay's TLS files (required when ``host`` is not loopback, unless
            ``insecure``): it presents ``cert`` (valid for ``host``) and admits only nodes
            presenting a certificate of ``ca`` (mutual TLS), then checks the token.
        insecure: Exposed without TLS: the token is still proved (HMAC, never sent), but
            weights and updates cross the network in the clear.
        start_method: How the local SuperNodes start their ClientApps (one process per Flower
            message either way): ``forkserver`` (forked from one process, shared by all local
            nodes, that imported torch and Flower once) or ``spawn`` (Flower's own: a fresh
            interpreter per message); see :func:`supernode_command`.
        poll_s: How often Flower's idle SuperNodes ask for a message, its ServerApp for the
            replies and its SuperExecs for a process to start, in (0, 3] s (3: Flower's own
            sleeps, most of a short round; :mod:`~torsh_distributed.federated._flower_polls`).
            Remote nodes poll as their ``torsh-dist federated-node --poll`` says.
    """

    config: FederatedConfig
    host: str = "127.0.0.1"
    local_nodes: bool = True
    echo: Callable[[str], None] = print
    port: int = 0
    token: str = field(default="", repr=False)
    tls: TLSFiles | None = None
    insecure: bool = False
    start_method: str = "forkserver"
    poll_s: float = DEFAULT_POLL_S
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[IO[bytes]] = field(default_factory=list)
    _link_port: int = 0
    _relay: Relay | None = None
    _ports: set[int] = field(default_factory=set)
    """Ports of the SuperLinks and SuperNodes started here (their app processes name them)."""
    _apps_server: str | None = None
    """The address of the forkserver shared by this federation's apps (``forkserver`` only)."""

    def __post_init__(self) -> None:
        check_start_method(self.start_method)
        self.poll_s = check_poll(self.poll_s, name="poll_s (--poll)")
        # the ServerApp and the clients run in other directories: paths must not be relative
        self.config = dataclasses.replace(self.config, run_dir=str(Path(self.config.run_dir).resolve()))
        if not _is_loopback(self.host) and not self.token:
            raise ValueError(
                f"exposing the federation on {self.host} needs a shared token (--token-env VAR or "
                "--token-file FILE); the nodes join with the same token"
            )
        if not _is_loopback(self.host) and self.tls is None and not self.insecure:
            raise ValueError(
                f"exposing the federation on {self.host} without TLS would carry weights and updates in "
                "the clear: give --tls-ca/--tls-cert/--tls-key (torsh-dist federated makes a CA when none "
                "is given), or --insecure to accept that"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    @property
    def address(self) -> str:
        """Where the SuperLink listens (loopback of this host)."""
        return f"127.0.0.1:{self._link_port}"

    @property
    def public_address(self) -> str:
        """Where nodes join: the SuperLink itself on loopback, else the relay."""
        return f"{self.host}:{self.port}"

    def _spawn(
        self, name: str, cmd: list[str], *, home: Path | None = None, pass_fds: tuple[int, ...] = ()
    ) -> subprocess.Popen[bytes]:
        if "--port" in cmd:
            self._ports.add(int(cmd[cmd.index("--port") + 1]))
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = (log_dir / f"{name}.log").open("ab")
        self._logs.append(log)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(home or self.run_dir / "flwr" / "home", poll_s=self.poll_s),
            cwd=self.run_dir, start_new_session=True, preexec_fn=_die_with_parent, pass_fds=pass_fds,
        )  # fmt: skip
        self.procs[name] = proc
        return proc

    def _start_clientapp_server(self) -> str | None:
        """``forkserver``: start (once) the forkserver that every local SuperNode forks its
        ClientApps from, and every SuperLink started here its ServerApps (torch, Flower and the
        engine imported once for the federation, not once per node and per run: ~3.4 CPU-s and a
        torch-sized process less per further client, ~3.5 CPU-s less per ServerApp); returns
        its address. ``spawn``: None."""
        if self.start_method != "forkserver" or self._apps_server is not None:
            return self._apps_server
        from multiprocessing import connection

        # a path only this user can open, as the stdlib's forkserver makes its own
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        with listener:
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            fd = listener.fileno()
            self._spawn("clientapps", [sys.executable, "-m", "torsh_distributed.federated._warm_node",
                                       "--serve-clientapps", str(fd)], pass_fds=(fd,))  # fmt: skip
        self._apps_server = address
        return address

    @contextlib.contextmanager
    def running(self) -> Iterator[Federation]:
        """Start the SuperLink (and local SuperNodes); stop everything on exit."""
        (self.run_dir / "flwr" / "home").mkdir(parents=True, exist_ok=True)
        try:
            exposed = not _is_loopback(self.host)
            self.port = self.port or free_port(self.host)
            self._link_port = free_port() if exposed else self.port
            self._start_clientapp_server()
            self.start_superlink("superlink", self.run_dir / "flwr", port=self._link_port)
            if exposed:
                self._relay = Relay(
                    role="server", listen=(self.host, self.port), target=("127.0.0.1", self._link_port),
                    token=self.token.encode(), tls=self.tls.server() if self.tls is not None else None,
                    report=self.echo,
                ).start()  # fmt: skip
            if self.local_nodes and self.config.regions:
                self.start_regions()
            elif self.local_nodes:
                server = self._start_clientapp_server()
                for pid in range(self.config.clients):
                    cmd = supernode_command(
                        self.address, partition_id=pid, num_partitions=self.config.clients,
                        port=free_port(), start_method=self.start_method, clientapp_server=server,
                    )  # fmt: skip
                    self._spawn(f"supernode-{pid}", cmd)
            yield self
        finally:
            self.stop()

    def start_regions(self) -> list[dict[str, Any]]:
        """Start each region's SuperLink, its clients' SuperNodes and its regional SuperNode
        (joined to this SuperLink) on this host (:mod:`~torsh_distributed.federated.hierarchy`);
        returns what was started, per region."""
        config = self.config
        started = []
        server = self._start_clientapp_server()
        for region in range(config.regions):
            state = self.run_dir / "regions" / f"region{region}" / "flwr"
            link = f"127.0.0.1:{self.start_superlink(f'region{region}-superlink', state)}"
            for pid in config.region_members(region):
                cmd = supernode_command(
                    link, partition_id=pid, num_partitions=config.clients, port=free_port(),
                    start_method=self.start_method, clientapp_server=server,
                )  # fmt: skip
                self._spawn(f"region{region}-supernode-{pid}", cmd, home=state / "home")
            cmd = supernode_command(
                self.address, partition_id=region, num_partitions=config.regions, port=free_port(),
                start_method=self.start_method, clientapp_server=server,
            )  # fmt: skip
            cmd[-1] = f'region-id={region} num-regions={config.regions} region-superlink="{link}"'
            self._spawn(f"region{region}-aggregator", cmd)
            started.append({"region": region, "superlink": link, "clients": config.region_members(region)})
        return started

    def start_superlink(self, name: str, state_dir: Path, *, port: int = 0) -> int:
        """Start a SuperLink on 127.0.0.1 (its database in ``state_dir``); returns its port.

        ``forkserver``: the SuperLink runs with ``--isolation process`` and its SuperExec is
        ``_warm_node --superlink-pid`` (log ``NAME-serverapps``), which forks each run's
        ``flwr-serverapp`` from the federation's forkserver instead of starting an interpreter
        that imports torch and Flower again; the SuperExec and the ServerApp end with the
        SuperLink, as Flower's own do. ``spawn``: Flower's own SuperExec."""
        port = port or free_port()
        state_dir.mkdir(parents=True, exist_ok=True)
        # Flower's in-memory state: its SQLite file locked under load and broke the log stream;
        # a resumed server starts from our own checkpoints anyway
        cmd = [_bin("flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port)]
        server = self._start_clientapp_server()
        if server is not None:
            cmd[1:1] = ["--isolation", "process"]
        proc = self._spawn(name, cmd, home=state_dir / "home")
        if server is not None:
            self._spawn(f"{name}-serverapps", [
                sys.executable, "-m", "torsh_distributed.federated._warm_node", "--runtime-api-address",
                f"127.0.0.1:{port}", "--clientapp-server", server, "--superlink-pid", str(proc.pid),
            ], home=state_dir / "home")  # fmt: skip
        _wait_port("127.0.0.1", port, proc, what=name, timeout=scaled_start_timeout(60))
        return port

    def submit(self, *, timeout: float, app: Path | None = None, run_config: str = "") -> int:
        """Submit the run and stream it until it ends; returns ``flwr run``'s exit code.

        Args:
            timeout: Seconds the whole run may take.
            app: Your own Flower app directory (its ``pyproject.toml`` names its ``ServerApp``
                and a ``ClientApp``, e.g. the engine's ``torsh_distributed.federated.apps:
                client_app``) instead of this run's; its output is echoed line by line.
            run_config: ``flwr run --run-config`` overrides of ``app``'s config (``k=v ...``).

        Raises:
            TimeoutError: the run did not end within ``timeout`` seconds (it is stopped).
        """
        flwr = self.run_dir / "flwr"
        home = flwr / "home"
        if app is None:
            app = flwr / "app"
            app.mkdir(parents=True, exist_ok=True)
            pyproject = _APP_PYPROJECT
            if self.config.secagg:  # the clients answer SecAgg+'s stages (secaggplus_mod)
                pyproject = pyproject.replace(_CLIENT_COMPONENT, _SECAGG_CLIENT_COMPONENT)
            (app / "pyproject.toml").write_text(pyproject)
            spec = self.run_dir / "spec.json"
            spec.write_text(self.config.to_json())
            run_config = f'spec="{spec}"'
            own = False
        else:
            app, own = Path(app).resolve(), True
            if not (app / "pyproject.toml").is_file():
                raise ValueError(f"--app {app}: no pyproject.toml (a Flower app directory has one)")
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "torsh"\n\n[superlink.torsh]\naddress = "{self.address}"\n'
            "insecure = true\n"
        )
        env = _env(home, poll_s=self.poll_s)
        cmd = [_bin("flwr"), "run", str(app), "torsh", "--stream"]
        if run_config:
            cmd += ["--run-config", run_config]
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        log = (self.run_dir / "logs" / "flwr-run.log").open("ab")
        self._logs.append(log)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=self.run_dir,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.procs["flwr-run"] = proc
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        run_id = ""
        for raw in proc.stdout:
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace").rstrip()
            if not run_id and (found := _RUN_ID.search(line)):
                run_id = found.group(1)
            at = line.find("federated:")
            text = line[at:] if at >= 0 else ""
            if own or text.startswith("federated:") or "Traceback" in line or "Error" in line:
                self.echo(line if own else text or line)
            if time.monotonic() > deadline:
                break
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the federated run did not end within {timeout:.0f} s") from None
        if code == 0 and run_id:  # the log stream can end before the run: wait for the run
            status = self._wait_run(run_id, env=env, deadline=deadline)
            if not status.endswith("completed"):
                self.echo(f"federated: run {run_id} ended as {status or 'unknown'} (logs in {self.run_dir / 'logs'})")
                return 1
        return code

    def _wait_run(self, run_id: str, *, env: dict[str, str], deadline: float) -> str:
        """Poll the SuperLink until run ``run_id`` is finished; returns its status text
        (``finished:completed``, ``finished:failed``, ...; empty when it cannot be read)."""
        status = ""
        while time.monotonic() < deadline:
            out = subprocess.run(
                [_bin("flwr"), "ls", "torsh", "--run-id", run_id, "--format", "json"],
                capture_output=True, text=True, env=env, cwd=self.run_dir, check=False,
            )  # fmt: skip
            try:
                runs = json.loads(out.stdout).get("runs", [])
                status = str(runs[0]["status"]) if runs else status
            except (ValueError, KeyError, IndexError):
                pass
            if status.startswith("finished"):
                return status
            time.sleep(1.0)
        raise TimeoutError(f"the federated run {run_id} did not end in time (status {status or 'unknown'})")

    def stop(self) -> None:
        """Stop every process started (SIGTERM, then SIGKILL after 5 s), close the logs."""
        if self._relay is not None:
            self._relay.stop()
            self._relay = None
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _kill_apps(self._ports)
        self.procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
