"""A :class:`torch.distributed.Store` kept in Redis, for rendezvous without a rank-0 server.

``RedisStore`` is a real Python subclass of torch's ``Store``: torch's C++ side (Gloo's
rendezvous, the store-based barrier, ``PrefixStore``) calls back into it, so it can be passed
straight to ``init_process_group``::

    store = RedisStore("10.0.0.5", 6379, password=os.environ["REDIS_PASSWORD"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)

It behaves like torch's ``TCPStore``: ``get`` and ``wait`` block until the keys exist or the
store timeout passes (then raise :class:`torch.distributed.DistStoreError`), ``add`` is atomic
and its counter reads back as decimal bytes, ``compare_set`` has TCPStore's rules. Unlike
TCPStore the server outlives the job, so every key lives under a per-job ``prefix`` and
:meth:`RedisStore.clear` removes them.

Security: the Redis password is the job's shared secret; anyone who has it can read and forge
rendezvous keys. Bind ``redis-server`` to ``127.0.0.1`` (or a private interface) unless ranks on
other hosts need it, and set ``requirepass`` whenever it listens beyond localhost.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from torsh_distributed.runtime.errors import (
    CommunicationError,
    ConfigurationError,
    FeatureNotAvailableError,
)

__all__ = ["RedisStore", "default_prefix", "DEFAULT_STORE_TIMEOUT"]

T = TypeVar("T")

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)
"""Same default as torch's stores."""

_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.02
_JOB_ID_VARS = ("TORSH_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")

# torch keeps only the C++ half of a Python Store alive: once the Python object is collected,
# calls from C++ fail with "Not implemented". Every live store is therefore pinned here until
# close(), so `init_process_group(store=RedisStore(...))` and C++-side clone() are safe.
_LIVE: dict[int, RedisStore] = {}

# TCPStore semantics: a missing key is created only when `expected` is empty; otherwise the
# caller gets `expected` back (torch "lies" here too). An existing key changes only on a match.
_COMPARE_SET_LUA = """
local current = redis.call('GET', KEYS[1])
if not current then
  if ARGV[1] == '' then
    redis.call('SET', KEYS[1], ARGV[2])
    return ARGV[2]
  end
  return ARGV[1]
end
if current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return ARGV[2]
end
return current
"""


def default_prefix(env: Mapping[str, str] | None = None) -> str:
    """The key prefix every rank of one job derives alike and another job does not.

    Uses the first of ``TORSH_JOB_ID``, ``TORCHELASTIC_RUN_ID`` (unless ``"none"``) and
    ``SLURM_JOB_ID``, else ``MASTER_ADDR:MASTER_PORT``, else ``"default"``.

    Args:
        env: Environment to read instead of ``os.environ``.
    """
    env = os.environ if env is None else env
    for var in _JOB_ID_VARS:
        value = env.get(var, "")
        if value and value != "none":
            return f"torsh/{value}/"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"torsh/{env['MASTER_ADDR']}:{env['MASTER_PORT']}/"
    return "torsh/default/"


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise FeatureNotAvailableError(
            "RedisStore needs the 'redis' package, which is not installed.",
            operation="RedisStore",
            fix="pip install torsh-distributed[redis]",
        ) from exc
    return redis


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: timedelta | float) -> float:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


class RedisStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in a Redis database.

    Args:
        host: Redis host. Keep the default ``127.0.0.1`` unless ranks run on other machines.
        port: Redis port.
        db: Redis database number; another way to keep jobs apart.
        password: ``requirepass`` of the server: the shared token of the job. ``None`` for a
            server without authentication (only acceptable on a trusted, local interface).
        prefix: Prepended to every key so jobs sharing a server do not collide and
            :meth:`num_keys` / :meth:`clear` touch only this job's keys. Must be equal on all
            ranks and differ between jobs (and between reruns, or call :meth:`clear` first);
            the default comes from :func:`default_prefix`. ``""`` shares the whole database.
        timeout: How long ``get`` / ``wait`` block before raising ``DistStoreError`` (torch's
            ``set_timeout`` changes it later). Zero waits forever. Longer survives slow peers,
            shorter reports a dead peer sooner. A single Redis reply may take
            ``max(timeout, 30 s)`` before the connection counts as lost.

    A store pins itself in memory until :meth:`close`: torch holds only the C++ half of a
    Python store, so ``init_process_group(store=RedisStore(...))`` would otherwise break as soon
    as the Python object is collected. Close it after ``destroy_process_group``.

    Raises:
        FeatureNotAvailableError: the ``redis`` package is missing.
        CommunicationError: no Redis server answers at ``host:port``.
        ConfigurationError: the server rejected the password (or needs one).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        *,
        db: int = 0,
        password: str | None = None,
        prefix: str | None = None,
        timeout: timedelta | float = DEFAULT_STORE_TIMEOUT,
    ) -> None:
        super().__init__()
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        seconds = _seconds(timeout)
        if seconds < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        self.set_timeout(timedelta(seconds=seconds))
        self._host, self._port, self._db, self._password = host, int(port), int(db), password
        self._prefix = default_prefix() if prefix is None else prefix
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._response_error = redis.ResponseError
        self._client = redis.Redis(
            host=host,
            port=self._port,
            db=self._db,
            password=password,
            socket_connect_timeout=min(seconds or 10.0, 10.0),
            socket_timeout=max(seconds, 30.0) if seconds else None,
            decode_responses=False,
            # No silent retries: a re-sent INCRBY whose reply was lost would count twice.
            retry=Retry(NoBackoff(), 0),
        )
        try:
            self._client.ping()
        except redis.AuthenticationError as exc:
            what = "requires a password" if password is None else "rejected the password"
            raise ConfigurationError(
                f"Redis at {self._where} {what} ({exc})",
                operation="RedisStore",
                fix="pass the server's requirepass as password= (or in redis://:PASSWORD@host:port).",
            ) from exc
        except redis.ResponseError as exc:
            if "AUTH" not in str(exc).upper():
                raise
            raise ConfigurationError(
                f"Redis at {self._where} refused authentication: {exc}",
                operation="RedisStore",
                fix="drop password= for a server without requirepass, or set requirepass.",
            ) from exc
        except self._errors as exc:
            raise CommunicationError(
                f"cannot reach Redis at {self._where}: {exc}",
                operation="RedisStore",
                fix=f"start redis-server on {self._where} (e.g. `redis-server --port "
                f"{self._port} --bind 127.0.0.1`) or point host/port at the running one.",
            ) from exc
        self._compare_set = self._client.register_script(_COMPARE_SET_LUA)
        _LIVE[id(self)] = self

    @property
    def _where(self) -> str:
        return f"{self._host}:{self._port}"

    @property
    def host(self) -> str:
        """Host of the Redis server."""
        return self._host

    @property
    def port(self) -> int:
        """Port of the Redis server."""
        return self._port

    @property
    def prefix(self) -> str:
        """The prefix in front of every key of this store."""
        return self._prefix

    def __repr__(self) -> str:
        return (
            f"RedisStore(host={self._host!r}, port={self._port}, db={self._db}, "
            f"prefix={self._prefix!r})"
        )

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one Redis command; a lost server becomes torch's ``DistNetworkError``."""
        try:
            return fn(*args)
        except self._errors as exc:
            raise dist.DistNetworkError(
                f"RedisStore lost Redis at {self._where}: {exc}. "
                "Check that redis-server is still running and reachable."
            ) from exc

    def _poll(self, fetch: Callable[[], T | None], keys: Sequence[str], timeout: float) -> T:
        """Call ``fetch`` until it returns non-``None``, backing off from 1 ms to 20 ms."""
        deadline = time.monotonic() + timeout if timeout > 0 else None
        delay = _POLL_FIRST_S
        while True:
            result = self._call(fetch)
            if result is not None:
                return result
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(
                        f"wait timeout after {timeout * 1000:.0f}ms, keys: {', '.join(keys)} "
                        f"(RedisStore {self._where}, prefix {self._prefix!r}): a peer never "
                        "set them; check that every rank started and uses the same prefix"
                    )
                delay = min(delay, left)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""
        self._call(self._client.set, self._key(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, blocking until it is set or the store timeout passes.

        Raises:
            torch.distributed.DistStoreError: the key did not appear within the timeout.
        """
        full = self._key(key)
        return self._poll(lambda: self._client.get(full), [key], self.timeout.total_seconds())

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the integer at ``key`` (missing counts as 0); return it."""
        try:
            return int(self._call(self._client.incrby, self._key(key), int(value)))
        except self._response_error as exc:
            raise ValueError(f"add({key!r}, {value}): the key holds a non-integer ({exc})") from exc

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Atomically set ``key`` to ``desired_value`` if it holds ``expected_value``.

        A missing key is created only when ``expected_value`` is empty. Returns the value the
        key holds afterwards (for a missing key and a non-empty expectation, ``expected_value``
        itself, as TCPStore does).
        """
        args = [_as_bytes(expected_value), _as_bytes(desired_value)]
        return bytes(self._call(self._compare_set, [self._key(key)], args))

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists, for ``timeout`` or else the store timeout.

        Raises:
            torch.distributed.DistStoreError: some key did not appear in time.
        """
        if not keys:
            return
        full = [self._key(k) for k in keys]
        seconds = _seconds(timeout if timeout is not None else self.timeout)

        def exists() -> bool | None:
            return True if self._client.exists(*full) == len(full) else None

        self._poll(exists, keys, seconds)

    def check(self, keys: list[str]) -> bool:
        """True if every key exists now (no waiting)."""
        if not keys:
            return True
        return self._call(self._client.exists, *[self._key(k) for k in keys]) == len(keys)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return self._call(self._client.delete, self._key(key)) == 1

    def num_keys(self) -> int:
        """Number of keys under this store's prefix (other jobs' keys are not counted)."""
        return len(self._scan())

    def list_keys(self) -> list[str]:
        """This store's keys, without the prefix, in no particular order."""
        cut = len(self._prefix.encode())
        return [k[cut:].decode(errors="replace") for k in self._scan()]

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (creating it)."""
        self._call(self._client.append, self._key(key), _as_bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys`` in one round trip, blocking until all exist (like TCPStore)."""
        if not keys:
            return []
        full = [self._key(k) for k in keys]

        def fetch() -> list[bytes] | None:
            values = self._client.mget(full)
            return None if any(v is None for v in values) else values

        return self._poll(fetch, keys, self.timeout.total_seconds())

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set several keys atomically."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        if keys:
            mapping = {self._key(k): _as_bytes(v) for k, v in zip(keys, values, strict=True)}
            self._call(self._client.mset, mapping)

    def has_extended_api(self) -> bool:
        """True: ``append`` / ``multi_get`` / ``multi_set`` are native, so Gloo may use them."""
        return True

    def clone(self) -> RedisStore:
        """A new store on its own connection pool with the same server, prefix and timeout."""
        return RedisStore(
            self._host,
            self._port,
            db=self._db,
            password=self._password,
            prefix=self._prefix,
            timeout=self.timeout,
        )

    def clear(self) -> int:
        """Delete every key under this store's prefix; return how many there were.

        Call it before a rerun that reuses a prefix, and never while ranks are still using it.
        """
        keys = self._scan()
        for start in range(0, len(keys), 1000):
            self._call(self._client.unlink, *keys[start : start + 1000])
        return len(keys)

    def close(self) -> None:
        """Close the connections and unpin the store (the keys stay; see :meth:`clear`).

        Only call it once torch no longer uses the store (after ``destroy_process_group``).
        """
        _LIVE.pop(id(self), None)
        self._client.close()

    # torch's C++ trampoline looks these two up by their C++ names (e.g. when a PrefixStore
    # wrapping this store is asked for num_keys); without them it reports a pure virtual call.
    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802
        return self.delete_key(key)

    def _scan(self) -> list[bytes]:
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._prefix) + "*"
        return self._call(lambda: list(self._client.scan_iter(match=pattern, count=1000)))
