"""create_store: URL validation and round-trips through the memory, file and TCP stores."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from torsh_distributed.runtime.errors import (
    CommunicationError,
    DistributedTimeoutError,
    FeatureNotAvailableError,
    RankOutOfRangeError,
)
from torsh_distributed.runtime.redis_store import RedisStore, default_prefix
from torsh_distributed.runtime.stores import _parse_url, _redact, create_store
from torsh_distributed.testing import find_free_port


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("http://example.com:80", "unknown scheme 'http'"),
        ("localhost:29500", "unknown scheme"),
        ("", "unknown scheme '\\(none\\)'"),
        ("tcp://127.0.0.1", "missing port"),
        ("redis://127.0.0.1", "missing port"),
        ("tcp://127.0.0.1:0", "port 0 is out of range 1-65535"),
        ("tcp://127.0.0.1:70000", "not a number in 1-65535"),
        ("redis://127.0.0.1:abc", "not a number in 1-65535"),
        ("file://relative/path", "absolute path"),
        ("file:relative", "unknown scheme"),
        ("memory://somewhere", "memory:// takes no host"),
        ("tcp://127.0.0.1:29500/path", "tcp:// takes only host:port"),
        ("redis://127.0.0.1:6379/zero", "database number"),
        ("redis://127.0.0.1:6379/0?prefx=a", "unknown query parameter"),
        ("redis://alice:pw@127.0.0.1:6379", "ACL user names"),
    ],
)
def test_bad_urls_name_the_url_and_the_allowed_forms(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        create_store(url)
    message = str(info.value)
    assert "tcp://host:port" in message and "file:///absolute/path" in message
    assert "bad store URL" in message


def test_password_never_appears_in_errors() -> None:
    with pytest.raises(ValueError, match=r"redis://:\*\*\*@127.0.0.1:6379/x") as info:
        create_store("redis://:s3cret@127.0.0.1:6379/x")
    assert "s3cret" not in str(info.value)
    assert _redact("redis://:a%40b@h:1/2?prefix=p") == "redis://:***@h:1/2?prefix=p"
    assert _redact("tcp://h:1") == "tcp://h:1"


def test_redis_url_parts() -> None:
    spec = _parse_url("redis://:p%40ss@10.0.0.5:6380/3?prefix=job42/")
    assert (spec.host, spec.port, spec.db, spec.password, spec.prefix) == (
        "10.0.0.5",
        6380,
        3,
        "p@ss",
        "job42/",
    )
    spec = _parse_url("redis://:6379")
    assert (spec.host, spec.db, spec.password, spec.prefix) == ("127.0.0.1", 0, None, None)
    assert _parse_url("tcp://:29500").host == "127.0.0.1"
    assert _parse_url("file:///tmp/a%20b").path == "/tmp/a b"


def test_argument_validation() -> None:
    with pytest.raises(RankOutOfRangeError, match="rank 2 is out of range for world_size 2"):
        create_store("memory://", rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        create_store("memory://", world_size=0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        create_store("memory://", timeout=0)
    with pytest.raises(ValueError, match="is_server only applies to tcp://"):
        create_store("memory://", is_server=True)
    with pytest.raises(ValueError, match="password only applies to redis://"):
        create_store("tcp://127.0.0.1:29500", password="x")
    with pytest.raises(ValueError, match="different passwords"):
        create_store("redis://:a@127.0.0.1:6379", password="b")
    with pytest.raises(TypeError, match="store URL must be a str"):
        create_store(None)  # type: ignore[arg-type]


def _round_trip(store: dist.Store) -> None:
    store.set("key", "value")
    assert store.get("key") == b"value"
    store.set("bin", b"\x00\xff")
    assert store.get("bin") == b"\x00\xff"
    assert store.add("counter", 5) == 5
    assert store.add("counter", -2) == 3
    assert store.get("counter") == b"3"
    assert store.check(["key", "counter"])
    assert not store.check(["key", "missing"])


def test_memory_store_round_trip_and_timeout() -> None:
    store = create_store("memory://", timeout=0.2)
    assert isinstance(store, dist.HashStore)
    assert store.timeout == timedelta(seconds=0.2)
    _round_trip(store)
    with pytest.raises(dist.DistStoreError):
        store.get("never-set")


def test_file_store_is_shared_between_instances(tmp_path) -> None:
    url = f"file://{tmp_path}/store"
    first = create_store(url, rank=0, world_size=2, timeout=5)
    second = create_store(url, rank=1, world_size=2, timeout=5)
    assert isinstance(first, dist.FileStore)
    _round_trip(first)
    assert second.get("key") == b"value"
    assert second.add("counter", 1) == 4


def test_tcp_store_server_and_client() -> None:
    port = find_free_port()
    server = create_store(f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=5)
    client = create_store(f"tcp://:{port}", rank=1, world_size=2, timeout=5)
    assert isinstance(server, dist.TCPStore) and isinstance(client, dist.TCPStore)
    _round_trip(client)
    assert server.get("counter") == b"3"
    assert (server.host, server.port) == ("127.0.0.1", port)


def test_tcp_store_server_listens_on_its_host_only() -> None:
    """torch's TCPStore alone binds every interface (*:port); ours binds the URL's host."""
    port = find_free_port()
    server = create_store(f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=5)
    listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
    local = {line.split()[1] for line in listening if line.split()[3] == "0A"}  # 0A = LISTEN
    assert f"0100007F:{port:04X}" in local  # 127.0.0.1:port
    assert f"00000000:{port:04X}" not in local  # not 0.0.0.0:port
    six = Path("/proc/net/tcp6")
    if six.exists():  # nor [::]:port
        lines = six.read_text().splitlines()[1:]
        assert not any(line.split()[1] == f"{'0' * 32}:{port:04X}" for line in lines)
    del server


def test_tcp_client_without_server_times_out() -> None:
    port = find_free_port()
    with pytest.raises(
        DistributedTimeoutError, match=f"no TCP store answered at 127.0.0.1:{port}"
    ) as info:
        create_store(f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=0.3)
    assert info.value.rank == 1 and info.value.operation == "create_store"
    assert "start rank 0" in str(info.value)


def test_tcp_server_on_a_busy_port_says_so() -> None:
    port = find_free_port()
    first = create_store(f"tcp://127.0.0.1:{port}", timeout=5)
    with pytest.raises(CommunicationError, match=f"cannot serve the TCP store on 127.0.0.1:{port}"):
        create_store(f"tcp://127.0.0.1:{port}", is_server=True, timeout=5)
    del first


def test_redis_store_without_redis_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # makes `import redis` raise ImportError
    with pytest.raises(FeatureNotAvailableError, match=r"pip install torsh-distributed\[redis\]"):
        RedisStore()
    with pytest.raises(FeatureNotAvailableError, match="needs the 'redis' package"):
        create_store("redis://127.0.0.1:6379")


def test_default_prefix_separates_jobs() -> None:
    assert default_prefix({"TORSH_JOB_ID": "a", "SLURM_JOB_ID": "7"}) == "torsh/a/"
    assert default_prefix({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7"}) == "torsh/7/"
    one = default_prefix({"MASTER_ADDR": "h", "MASTER_PORT": "1"})
    two = default_prefix({"MASTER_ADDR": "h", "MASTER_PORT": "2"})
    assert one != two
    assert default_prefix({}) == "torsh/default/"
