"""Real servers for integration tests: throwaway ``redis-server`` processes on 127.0.0.1; the
tiny checkpoint that the serving tests serve (trained once per session)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from torsh_distributed.testing import find_free_port
from torsh_distributed.testing.cli import run_cli

REDIS_PASSWORD = "torsh-test-token"


class RedisServer(NamedTuple):
    """Where a test server listens; unpacks as ``host, port = redis_server``."""

    host: str
    port: int


def _ping(port: int, password: str | None) -> bool:
    """True once the server answers PING (+PONG, or -NOAUTH when it wants a password)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or (password is not None and reply.startswith(b"-NOAUTH"))


class RedisProcess:
    """A ``redis-server`` child process: no persistence, bound to 127.0.0.1, a free port."""

    def __init__(self, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip(
                "redis-server not installed: run `make test` as root (installs it) "
                "or apt-get install redis-server"
            )
        output = ""
        for _attempt in range(3):  # the free port can be taken between probe and bind
            port = find_free_port()
            cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            cmd += ["--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
            if password is not None:
                cmd += ["--requirepass", password]
            self._log = tempfile.TemporaryFile()  # not a pipe: a full pipe would stall redis
            self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 10.0
            while self._proc.poll() is None and time.monotonic() < deadline:
                if _ping(port, password):
                    self.address = RedisServer("127.0.0.1", port)
                    return
                time.sleep(0.01)
            self.stop()
            self._log.seek(0)
            output = self._log.read().decode(errors="replace")
        pytest.fail(f"redis-server did not start: {output[-2000:]}")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and reap it; safe to call twice."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A shared redis-server without a password; yields ``(host, port)``."""
    server = RedisProcess()
    yield server.address
    server.stop()


@pytest.fixture(scope="session")
def redis_server_auth() -> Iterator[RedisServer]:
    """A shared redis-server started with ``--requirepass``; yields ``(host, port)``."""
    server = RedisProcess(REDIS_PASSWORD)
    yield server.address
    server.stop()


@pytest.fixture
def redis_password() -> str:
    """The password of :func:`redis_server_auth`."""
    return REDIS_PASSWORD


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    """A private redis-server the test may stop (``.address``, ``.stop()``)."""
    server = RedisProcess()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 20-step ``tiny`` training run's checkpoint directory (its name, ``ckpt``, is the served
    model's id)."""
    root = tmp_path_factory.mktemp("serve") / "ckpt"
    proc = run_cli(  # a warm process (torsh_distributed.testing.cli)
        ["train", "--preset", "tiny", "--max-steps", "20", "--checkpoint-dir", str(root),
         "--progress", "false"],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return str(root)
