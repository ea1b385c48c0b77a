"""Real servers for integration tests: a throwaway ``redis-server`` on 127.0.0.1."""

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

REDIS_PASSWORD = "torsh-test-token"


class RedisServer(NamedTuple):
    """Where a test server listens; unpacks as ``host, port = redis_server``."""

    host: str
    port: int


def _ping(port: int, password: str | None) -> bool:
    """True once the server answers PING (with +PONG, or -NOAUTH when it wants a password)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or (password is not None and reply.startswith(b"-NOAUTH"))


def _start_redis(password: str | None = None) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(
            "redis-server not installed: run `make test` as root (installs it) "
            "or apt-get install redis-server"
        )
    for _attempt in range(3):  # the free port can be taken between probe and bind
        port = find_free_port()
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--daemonize", "no", "--loglevel", "warning"]
        if password is not None:
            cmd += ["--requirepass", password]
        log = tempfile.TemporaryFile()  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10.0
        while proc.poll() is None and time.monotonic() < deadline and not _ping(port, password):
            time.sleep(0.01)
        if proc.poll() is None and _ping(port, password):
            break
        proc.kill()
        proc.wait()
        log.seek(0)
        output = log.read().decode(errors="replace")
        log.close()
    else:
        pytest.fail(f"redis-server did not start: {output[-2000:]}")
    try:
        yield RedisServer("127.0.0.1", port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server without a password; yields its host and port."""
    yield from _start_redis()


@pytest.fixture(scope="session")
def redis_server_auth() -> Iterator[RedisServer]:
    """A redis-server with ``--requirepass REDIS_PASSWORD``; yields its host and port."""
    yield from _start_redis(REDIS_PASSWORD)
