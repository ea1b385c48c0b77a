"""RedisStore against a real redis-server: every Store method, TCPStore parity, torch rendezvous."""

from __future__ import annotations

import gc
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torsh_distributed.runtime.errors import CommunicationError, ConfigurationError
from torsh_distributed.runtime.redis_store import RedisStore
from torsh_distributed.runtime.stores import create_store
from torsh_distributed.testing import find_free_port, run_distributed

pytestmark = pytest.mark.integration

pytest.importorskip("redis", reason="RedisStore needs `pip install torsh-distributed[redis]`")


# The fixture's store timeout: long enough that a busy host's scheduling never reaches it in the
# tests that bound a wait from above (half of it), which shows that the wait ended on its own
# event or its explicit timeout, not on this one.
STORE_TIMEOUT_S = 10.0


def _prefix() -> str:
    return f"test/{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def store(redis_server) -> Iterator[RedisStore]:
    host, port = redis_server
    store = RedisStore(host, port, prefix=_prefix(), timeout=STORE_TIMEOUT_S)
    yield store
    store.clear()
    store.close()


def _set_later(store: dist.Store, delay: float, **items: str) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        for key, value in items.items():
            store.set(key, value)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_is_a_torch_store(store: RedisStore) -> None:
    assert isinstance(store, dist.Store)
    assert store.timeout == timedelta(seconds=STORE_TIMEOUT_S)
    assert store.has_extended_api()


def test_set_get_str_and_bytes(store: RedisStore) -> None:
    store.set("text", "héllo")
    store.set("binary", b"\x00\x01\xff")
    assert store.get("text") == "héllo".encode()
    assert store.get("binary") == b"\x00\x01\xff"
    store.set("text", "")
    assert store.get("text") == b""


def test_get_blocks_until_another_thread_sets(store: RedisStore) -> None:
    start = time.monotonic()
    thread = _set_later(RedisStore(store.host, store.port, prefix=store.prefix), 0.2, late="here")
    assert store.get("late") == b"here"
    assert 0.15 < time.monotonic() - start < STORE_TIMEOUT_S / 2
    thread.join()


def test_get_times_out_with_dist_store_error(store: RedisStore) -> None:
    store.set_timeout(timedelta(milliseconds=200))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout after 200ms, keys: missing"):
        store.get("missing")
    assert 0.19 < time.monotonic() - start < STORE_TIMEOUT_S / 2


def test_wait_and_check(store: RedisStore) -> None:
    assert store.check([])
    store.wait([])
    thread = _set_later(store, 0.1, a="1", b="2")
    assert not store.check(["a", "b"])
    store.wait(["a", "b"])
    assert store.check(["a", "b"]) and store.check(["a", "a"])
    assert not store.check(["a", "nope"])
    thread.join()
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout after 100ms, keys: a, nope"):
        store.wait(["a", "nope"], timedelta(milliseconds=100))
    assert time.monotonic() - start < STORE_TIMEOUT_S / 2  # the explicit timeout, not the store's


def test_add_is_a_decimal_counter(store: RedisStore) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"
    store.set("m", "40")
    assert store.add("m", 2) == 42
    store.set("word", "abc")
    with pytest.raises(ValueError, match="holds a non-integer"):
        store.add("word", 1)


def _compare_set_script(store: dist.Store) -> list[object]:
    return [
        store.compare_set("k", "", "first"),  # missing key, empty expectation: created
        store.get("k"),
        store.compare_set("absent", "x", "y"),  # missing key, other expectation: not created
        store.check(["absent"]),
        store.compare_set("k", "first", "second"),  # match: swapped
        store.compare_set("k", "wrong", "third"),  # mismatch: current value returned
        store.compare_set("k", "", "fourth"),  # existing key, empty expectation: unchanged
        store.get("k"),
        store.compare_set("k", b"second", b"\x00bin"),
        store.get("k"),
    ]


def test_compare_set_matches_torch_stores(store: RedisStore) -> None:
    got = _compare_set_script(store)
    assert got == _compare_set_script(dist.HashStore())
    port = find_free_port()
    tcp = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))
    assert got == _compare_set_script(tcp)
    assert got[0] == b"first" and got[2] == b"x" and got[5] == b"second"


def test_delete_num_keys_and_prefix_isolation(store: RedisStore, redis_server) -> None:
    other = RedisStore(*redis_server, prefix=_prefix(), timeout=1.0)
    try:
        store.set("a", "1")
        store.add("b", 1)
        other.set("a", "other")
        assert store.num_keys() == 2 and other.num_keys() == 1
        assert sorted(store.list_keys()) == ["a", "b"]
        assert store.get("a") == b"1"
        assert store.delete_key("a") is True
        assert store.delete_key("a") is False
        assert store.num_keys() == 1
        assert other.get("a") == b"other"
        assert store.clear() == 1
        assert store.num_keys() == 0 and other.num_keys() == 1
    finally:
        other.clear()
        other.close()


def test_glob_characters_in_prefix_are_literal(redis_server) -> None:
    tricky = RedisStore(*redis_server, prefix=f"t[a-z]*?/{uuid.uuid4().hex}/", timeout=1.0)
    plain = RedisStore(*redis_server, prefix=tricky.prefix.replace("[a-z]*?", "ab"), timeout=1.0)
    try:
        plain.set("x", "1")
        tricky.set("y", "1")
        assert tricky.num_keys() == 1 and tricky.list_keys() == ["y"]
    finally:
        for s in (tricky, plain):
            s.clear()
            s.close()


def test_extended_api(store: RedisStore) -> None:
    store.append("log", "ab")
    store.append("log", b"cd")
    assert store.get("log") == b"abcd"
    store.multi_set(["x", "y"], ["1", b"2"])
    assert store.multi_get(["y", "x", "log"]) == [b"2", b"1", b"abcd"]
    assert store.multi_get([]) == []
    thread = _set_later(store, 0.1, z="3")
    assert store.multi_get(["x", "z"]) == [b"1", b"3"]  # blocks like TCPStore
    thread.join()
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["p", "q"], ["1"])


def test_called_from_cpp_through_prefix_store(store: RedisStore) -> None:
    """PrefixStore forwards to the trampoline, which looks methods up by C++ names."""
    wrapped = dist.PrefixStore("pg", store)
    wrapped.set("a", "1")
    assert store.get("pg/a") == b"1"
    assert wrapped.get("a") == b"1"
    assert wrapped.add("n", 3) == 3
    assert wrapped.compare_set("a", "1", "2") == b"2"
    assert wrapped.check(["a", "n"])
    wrapped.wait(["a"])
    wrapped.wait(["a"], timedelta(seconds=1))
    assert wrapped.num_keys() == 2  # C++ getNumKeys
    assert wrapped.delete_key("n")  # C++ deleteKey
    wrapped.multi_set(["m"], ["v"])
    assert wrapped.multi_get(["a", "m"]) == [b"2", b"v"]
    wrapped.append("m", "w")
    assert wrapped.get("m") == b"vw"
    wrapped.set_timeout(timedelta(milliseconds=100))  # torch sets timeouts through wrappers
    assert store.timeout == timedelta(milliseconds=100)
    with pytest.raises(dist.DistStoreError, match="wait timeout after 100ms, keys: pg/never"):
        wrapped.get("never")


def test_stays_alive_while_only_torch_holds_it(redis_server) -> None:
    """torch keeps only the C++ half of a Python store; the Python half must not be collected."""
    inner = RedisStore(*redis_server, prefix=_prefix(), timeout=1.0)
    ref = weakref.ref(inner)
    wrapped = dist.PrefixStore("pg", inner)
    del inner
    gc.collect()
    assert ref() is not None
    wrapped.set("k", "v")
    assert wrapped.get("k") == b"v"
    copy = wrapped.clone()  # C++ clone() -> Python clone(): a new store nobody references
    gc.collect()
    assert copy.get("k") == b"v"
    copy.set("k2", "v2")
    assert wrapped.get("k2") == b"v2"
    store = ref()
    assert store is not None  # can fail: the weak reference dies if torch dropped the Python store
    store.clear()
    store.close()
    del store
    gc.collect()
    assert ref() is None  # close() unpins it


def test_clone_shares_keys(store: RedisStore) -> None:
    copy = store.clone()
    try:
        assert isinstance(copy, RedisStore) and copy is not store
        assert copy.prefix == store.prefix and copy.timeout == store.timeout
        store.set("k", "v")
        assert copy.get("k") == b"v"
    finally:
        copy.close()


def test_password_right_and_wrong(redis_server_auth, redis_password: str) -> None:
    host, port = redis_server_auth
    good = RedisStore(host, port, password=redis_password, prefix=_prefix(), timeout=1.0)
    good.set("k", "v")
    assert good.get("k") == b"v"
    via_url = create_store(f"redis://:{redis_password}@{host}:{port}/0?prefix={good.prefix}")
    via_arg = create_store(f"redis://{host}:{port}?prefix={good.prefix}", password=redis_password)
    assert via_url.get("k") == b"v" and via_arg.get("k") == b"v"
    with pytest.raises(ConfigurationError, match=f"Redis at {host}:{port} rejected the password"):
        RedisStore(host, port, password="wrong", timeout=1.0)
    with pytest.raises(ConfigurationError, match=f"Redis at {host}:{port} requires a password"):
        RedisStore(host, port, timeout=1.0)
    for s in (good, via_url, via_arg):
        s.clear()
        s.close()


def test_database_number_from_url(redis_server) -> None:
    host, port = redis_server
    prefix = _prefix()
    db0 = create_store(f"redis://{host}:{port}/0?prefix={prefix}", timeout=1.0)
    db1 = create_store(f"redis://{host}:{port}/1?prefix={prefix}", timeout=1.0)
    db1.set("k", "one")
    assert not db0.check(["k"]) and db1.get("k") == b"one"
    for s in (db0, db1):
        s.clear()
        s.close()


def test_connection_refused_names_host_port_and_fix() -> None:
    port = find_free_port()
    with pytest.raises(CommunicationError, match=f"cannot reach Redis at 127.0.0.1:{port}") as info:
        RedisStore("127.0.0.1", port, timeout=1.0)
    assert "redis-server" in str(info.value) and info.value.fix


def test_lost_server_raises_dist_network_error(redis_process) -> None:
    host, port = redis_process.address
    store = RedisStore(host, port, prefix=_prefix(), timeout=1.0)
    store.set("k", "v")
    redis_process.stop()
    with pytest.raises(dist.DistNetworkError, match=f"lost Redis at {host}:{port}"):
        store.get("k")
    store.close()


# --- multi-process: torch's own rendezvous through the store ------------------------------


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _init_and_all_reduce(host: str, port: int, prefix: str) -> tuple[float, bytes]:
    rank, world_size = _rank_and_world()
    # No reference kept on purpose: torch must be able to hold the store on its own.
    dist.init_process_group(
        backend="gloo",
        store=RedisStore(host, port, prefix=prefix, timeout=20.0),
        rank=rank,
        world_size=world_size,
    )
    try:
        gc.collect()
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        group = dist.new_group(list(range(world_size)))  # rendezvous through the store again
        dist.barrier(group=group)
        peer = RedisStore(host, port, prefix=prefix, timeout=20.0)
        if rank == 0:
            time.sleep(0.2)  # rank 1's get must block until this set
            peer.set("from-rank0", "hello")
        message = peer.get("from-rank0")
        peer.close()
        return total.item(), message
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("init_barrier", ["0", "1"], ids=["plain", "store-barrier"])
def test_init_process_group_through_redis_store(redis_server, init_barrier: str) -> None:
    host, port = redis_server
    prefix = _prefix()
    results = run_distributed(
        _init_and_all_reduce,
        2,
        args=(host, port, prefix),
        init=False,
        timeout=60,
        env={"TORCH_DIST_INIT_BARRIER": init_barrier},  # "1": torch also calls add/wait(timeout)
    )
    assert results == [(3.0, b"hello"), (3.0, b"hello")]
    leftover = RedisStore(host, port, prefix=prefix, timeout=1.0)
    assert leftover.num_keys() > 0  # torch's rendezvous keys landed under our prefix
    leftover.clear()
    leftover.close()


def _add_many(host: str, port: int, prefix: str, num_adds: int) -> tuple[list[int], bytes]:
    rank, world_size = _rank_and_world()
    store = create_store(f"redis://{host}:{port}?prefix={prefix}", timeout=20.0)
    seen = [store.add("counter", 1) for _ in range(num_adds)]
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(world_size)])
    final = store.get("counter")
    store.close()  # type: ignore[attr-defined]
    return seen, final


def test_concurrent_add_loses_no_increment(redis_server) -> None:
    host, port = redis_server
    prefix = _prefix()
    results = run_distributed(_add_many, 4, args=(host, port, prefix, 200), init=False, timeout=60)
    assert [final for _, final in results] == [b"800"] * 4
    returned = sorted(value for seen, _ in results for value in seen)
    assert returned == list(range(1, 801))  # every add saw a distinct running total
    leftover = RedisStore(host, port, prefix=prefix, timeout=1.0)
    assert leftover.clear() == 5  # counter + 4 done keys
    leftover.close()
