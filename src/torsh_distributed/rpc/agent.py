"""Start and stop this process's RPC worker (torch's TensorPipe agent, rendezvous through our stores).

::

    from torsh_distributed import rpc

    with rpc.init(name=f"worker{rank}", rank=rank, world_size=2, master_port=29500):
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))

:func:`init` returns once every worker joined (a static group). :func:`shutdown` is graceful
by default: it waits, at most ``timeout`` seconds, for every peer to reach its own shutdown and
for in-flight calls to finish; when a peer is dead or stuck it shuts this worker down locally
instead and returns ``False``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import rpc as torch_rpc

from torsh_distributed.rpc import _rendezvous
from torsh_distributed.rpc.config import RPCConfig
from torsh_distributed.rpc.errors import RPCError
from torsh_distributed.runtime.env import environ_set
from torsh_distributed.runtime.errors import (
    ConfigurationError,
    DistributedTimeoutError,
    FeatureNotAvailableError,
)

__all__ = ["RPCContext", "init", "shutdown", "current", "is_initialized", "worker_names"]

log = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 2.0  # beyond shutdown_timeout, for torch's local teardown after a failed wait


@dataclass(frozen=True, kw_only=True, slots=True)
class RPCContext:
    """This process's running RPC worker; a context manager that shuts it down on exit."""

    config: RPCConfig
    """The settings it was started with."""
    worker_names: tuple[str, ...]
    """Names of every worker of the group, by rank."""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def rank(self) -> int:
        return self.config.rank

    def __enter__(self) -> RPCContext:
        return self

    def __exit__(self, *exc: object) -> None:
        shutdown()


_current: RPCContext | None = None
_listen_socket: socket.socket | None = None
_store: dist.Store | None = None
_interface_used: str | None = None


def _check_interface(name: str) -> None:
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise ValueError(f"interface {name!r} does not exist on this host; choose one of {names}")


@contextlib.contextmanager
def _listen_on(interface: str) -> Iterator[None]:
    """Make TensorPipe (``TP_SOCKET_IFNAME``, read once per process) and the Gloo group torch's
    agent builds at start-up (``GLOO_SOCKET_IFNAME``) use ``interface``; restore both after, so
    a later ``init_process_group`` of the user is unaffected."""
    with environ_set({key: interface for key in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}):
        yield


def init(config: RPCConfig | None = None, /, **fields: Any) -> RPCContext:
    """Start this process's RPC worker and wait for every peer to join.

    Args:
        config: An :class:`RPCConfig`; or leave it out and pass its fields as keywords
            (``init(name="w0", rank=0, world_size=2, master_port=29500)``).
        **fields: :class:`RPCConfig` fields, when ``config`` is not given.

    Returns:
        The :class:`RPCContext` (``with rpc.init(...):`` shuts down on exit).

    Raises:
        TypeError / ValueError: bad settings, raised before anything is started.
        RuntimeError: RPC is already initialized in this process.
        DistributedTimeoutError: peers did not join within ``rendezvous_timeout``.
        ConfigurationError: a peer holds another token.
        CommunicationError / RPCError: the store or the agent could not start.
    """
    global _current, _listen_socket, _store, _interface_used
    if config is None:
        config = RPCConfig(**fields)
    elif fields:
        raise TypeError("pass an RPCConfig or its fields as keywords, not both")
    elif not isinstance(config, RPCConfig):
        raise TypeError(f"config must be an RPCConfig, got {type(config).__name__}")
    if not torch_rpc.is_available() or not torch_rpc._is_tensorpipe_available:
        raise FeatureNotAvailableError(
            "this torch build has no torch.distributed.rpc (TensorPipe)",
            operation="rpc.init",
            fix="install a torch build with distributed support (Linux/macOS wheels have it).",
        )
    if _current is not None or torch_rpc._is_current_rpc_agent_set():
        raise RuntimeError("RPC is already initialized in this process; call rpc.shutdown() first")
    _check_interface(config.interface)
    if _interface_used not in (None, config.interface):
        warnings.warn(
            f"TensorPipe keeps the interface of the first init ({_interface_used!r}) for the "
            f"whole process; interface={config.interface!r} is ignored",
            stacklevel=2,
        )
    _interface_used = _interface_used or config.interface

    store, sock = _rendezvous.open_store(config)
    try:
        _rendezvous.check_token(store, config)
        options = torch_rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=config.num_worker_threads,
            rpc_timeout=config.timeout,
            init_method=_rendezvous.init_method_for(store, config.rank, config.world_size),
            # TCP only (no shm / cma / multiplexed channels): one listening socket, on the
            # chosen interface, and the same path whether peers share a host or not.
            _transports=["uv"],
            _channels=["basic"],
        )
        try:
            with _listen_on(_interface_used), warnings.catch_warnings():
                # torch's agent start-up all-gathers through a bare Gloo group and warns about it
                warnings.filterwarnings(
                    "ignore", message=".*as a ProcessGroup", category=UserWarning
                )
                torch_rpc.init_rpc(
                    config.name,
                    rank=config.rank,
                    world_size=config.world_size,
                    rpc_backend_options=options,
                )
        except RuntimeError as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise DistributedTimeoutError(
                    f"RPC agents did not connect within {config.timeout:.0f} s: {text}",
                    rank=config.rank,
                    operation="rpc.init",
                    fix="check that every worker can reach the others on the chosen interface.",
                ) from exc
            if "name" in text.lower() and ("used" in text.lower() or "unique" in text.lower()):
                raise ConfigurationError(
                    f"RPC worker name {config.name!r} is not unique: {text}",
                    rank=config.rank,
                    operation="rpc.init",
                    fix="give every worker its own name.",
                ) from exc
            raise RPCError(text, rank=config.rank, operation="rpc.init") from exc
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    agent = torch_rpc._get_current_rpc_agent()
    infos = sorted(agent.get_worker_infos(), key=lambda info: info.id)
    _current = RPCContext(config=config, worker_names=tuple(info.name for info in infos))
    _listen_socket, _store = sock, store
    log.debug("rpc worker %s up (%d workers)", config.name, len(infos))
    return _current


def shutdown(*, graceful: bool = True, timeout: float | None = None) -> bool:
    """Stop this process's RPC worker; safe to call twice or without :func:`init`.

    Args:
        graceful: Wait for every peer to reach its own ``shutdown`` and for in-flight calls to
            finish, so no peer loses an answer. ``False`` stops this worker at once (peers'
            calls to it then fail with :class:`PeerUnavailableError`).
        timeout: Seconds the graceful wait may take (default: the config's
            ``shutdown_timeout``). Past it, or as soon as a peer is found dead, this worker
            shuts down locally; the call returns within about ``timeout + 2`` s.

    Returns:
        ``True`` when the shutdown was graceful (or nothing was running), ``False`` when it fell
        back to a local shutdown (a warning is logged with the reason).
    """
    global _current, _listen_socket, _store
    ctx = _current
    if ctx is None:
        return True
    limit = ctx.config.shutdown_timeout if timeout is None else float(timeout)
    if not limit > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    ok = True
    try:
        if graceful:
            ok = _graceful(ctx.name, limit)
        else:
            _local_shutdown()
    finally:
        _current = None
        if _listen_socket is not None:
            _listen_socket.close()
        _listen_socket, _store = None, None
    return ok


def _local_shutdown() -> None:
    if torch_rpc._is_current_rpc_agent_set():
        try:
            torch_rpc.shutdown(graceful=False)
        except RuntimeError as exc:  # e.g. torch's RRef-leak check; the agent is down anyway
            log.warning("rpc: local shutdown reported: %s", str(exc).splitlines()[0])


def _graceful(name: str, limit: float) -> bool:
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            # torch's graceful path: an all-gather of every worker (bounded by `limit`), then a
            # drain of in-flight calls; on failure its `finally` shuts the agent down locally.
            torch_rpc.shutdown(graceful=True, timeout=limit)
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"torsh-rpc-shutdown-{name}", daemon=True)
    thread.start()
    thread.join(limit + _SHUTDOWN_GRACE_S)
    if thread.is_alive():
        log.warning(
            "rpc: graceful shutdown of %s did not finish within %.1f s; shutting down locally",
            name,
            limit,
        )
        _local_shutdown()
        return False
    error = outcome.get("error")
    if error is not None:
        log.warning(
            "rpc: graceful shutdown of %s failed (a peer is gone?), shut down locally: %s",
            name,
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        return False
    return True


def current() -> RPCContext | None:
    """The running worker's :class:`RPCContext`, or ``None``."""
    return _current


def is_initialized() -> bool:
    """True while this process's RPC worker runs."""
    return _current is not None


def worker_names() -> tuple[str, ...]:
    """Names of every worker of the group, by rank.

    Raises:
        RuntimeError: RPC is not initialized.
    """
    if _current is None:
        raise RuntimeError("RPC is not initialized; call torsh_distributed.rpc.init() first")
    return _current.worker_names
