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
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from torsh_distributed.federated.config import FederatedConfig

__all__ = ["Federation", "free_port", "supernode_command"]

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bin(name: str) -> str:
    """A console script of the running environment (Flower's live next to our Python)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _env(home: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if home is not None:  # Flower's apps, runtime envs and CLI config stay in the run directory
        env["FLWR_HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def supernode_command(
    superlink: str, *, partition_id: int, num_partitions: int, host: str = "127.0.0.1", port: int
) -> list[str]:
    """The ``flower-supernode`` command line of client ``partition_id``."""
    return [
        _bin("flower-supernode"), "--insecure", "--superlink", superlink,
        "--host", host, "--port", str(port),
        "--node-config", f"partition-id={partition_id} num-partitions={num_partitions}",
    ]  # fmt: skip


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

    Args:
        config: The run (its ``run_dir`` receives the spec, logs, checkpoints and summary).
        host: Address the SuperLink listens on (127.0.0.1 = this machine only).
        local_nodes: Start the SuperNodes here (False: they join from their hosts).
        echo: Receives the ServerApp's progress lines.
    """

    config: FederatedConfig
    host: str = "127.0.0.1"
    local_nodes: bool = True
    echo: Callable[[str], None] = print
    port: int = 0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[IO[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # the ServerApp and the clients run in other directories: paths must not be relative
        self.config = dataclasses.replace(self.config, run_dir=str(Path(self.config.run_dir).resolve()))

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = (log_dir / f"{name}.log").open("ab")
        self._logs.append(log)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(self.run_dir / "flwr" / "home"),
            cwd=self.run_dir,
            start_new_session=True,
        )  # fmt: skip
        self.procs[name] = proc
        return proc

    @contextlib.contextmanager
    def running(self) -> Iterator[Federation]:
        """Start the SuperLink (and local SuperNodes); stop everything on exit."""
        (self.run_dir / "flwr" / "home").mkdir(parents=True, exist_ok=True)
        try:
            self.port = self.port or free_port(self.host)
            superlink = self._spawn(
                "superlink",
                [
                    _bin("flower-superlink"), "--insecure", "--host", self.host, "--port", str(self.port),
                    "--database", str(self.run_dir / "flwr" / "superlink.db"),
                ],
            )  # fmt: skip
            _wait_port(self.host, self.port, superlink, what="flower-superlink", timeout=60)
            if self.local_nodes:
                for pid in range(self.config.clients):
                    cmd = supernode_command(
                        self.address, partition_id=pid, num_partitions=self.config.clients,
                        port=free_port(),
                    )  # fmt: skip
                    self._spawn(f"supernode-{pid}", cmd)
            yield self
        finally:
            self.stop()

    def submit(self, *, timeout: float) -> int:
        """Submit the run and stream it until it ends; returns ``flwr run``'s exit code.

        Raises:
            TimeoutError: the run did not end within ``timeout`` seconds (it is stopped).
        """
        flwr = self.run_dir / "flwr"
        app = flwr / "app"
        app.mkdir(parents=True, exist_ok=True)
        (app / "pyproject.toml").write_text(_APP_PYPROJECT)
        home = flwr / "home"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "torsh"\n\n[superlink.torsh]\naddress = "{self.address}"\n'
            "insecure = true\n"
        )
        spec = self.run_dir / "spec.json"
        spec.write_text(self.config.to_json())
        env = _env(home)
        cmd = [_bin("flwr"), "run", str(app), "torsh", "--stream", "--run-config", f'spec="{spec}"']
        log = (self.run_dir / "logs" / "flwr-run.log").open("ab")
        self._logs.append(log)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=self.run_dir,
            start_new_session=True,
        )  # fmt: skip
        self.procs["flwr-run"] = proc
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for raw in proc.stdout:
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace").rstrip()
            at = line.find("federated:")
            text = line[at:] if at >= 0 else ""
            if text.startswith("federated:") or "Traceback" in line or "Error" in line:
                self.echo(text or line)
            if time.monotonic() > deadline:
                break
        try:
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the federated run did not end within {timeout:.0f} s") from None

    def stop(self) -> None:
        """Stop every process started (SIGTERM, then SIGKILL after 5 s), close the logs."""
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
        self.procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
