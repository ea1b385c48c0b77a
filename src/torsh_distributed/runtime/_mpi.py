"""The rendezvous under Open MPI's ``mpirun`` when nobody exported ``MASTER_ADDR``.

Open MPI tells each rank who it is (``OMPI_COMM_WORLD_*``) but not where rank 0's store listens.
:func:`rendezvous` finds out, in the order set by ``TORSH_MPI_RENDEZVOUS``:

``auto`` (default)
    Over MPI when mpi4py imports and its ``COMM_WORLD`` is this job's, else derived from the
    environment (one node only).
``mpi4py``
    Over MPI or fail: rank 0 binds a *free* port (the kernel picks it, so it cannot be taken) on
    ``127.0.0.1`` when all ranks share its node, else on the address its node routes toward the
    first other node, starts the ``TCPStore`` on that very socket (``master_listen_fd``: no
    window between probing a port and binding it, and the store listens on that address only),
    and broadcasts ``host:port`` over ``MPI.COMM_WORLD``. ``import mpi4py`` initialises MPI
    (about 0.2 s); it stays initialised for the user's own mpi4py code and is finalised at exit.
``env``
    Never import mpi4py. One node only: ``127.0.0.1`` and a port hashed from the job's id
    (:meth:`MPIEnvironment.job_port`). That port is fixed, so another program (or, about one
    time in 12,000, a concurrent job) can hold it: rank 0 then fails with the port in the message.

``MASTER_PORT`` alone, if exported, replaces the free or derived port. On one node Gloo is pointed
at the loopback interface (``GLOO_SOCKET_IFNAME``) unless the user chose one. The store, like
every ``TCPStore``, is unauthenticated: anyone who reaches the port can join or disturb the job.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torsh_distributed.runtime._net import loopback_interface
from torsh_distributed.runtime.env import MPIEnvironment, WorldInfo
from torsh_distributed.runtime.errors import CommunicationError, ConfigurationError

__all__ = ["MODES", "RENDEZVOUS_VARIABLE", "MPIRendezvous", "rendezvous"]

log = logging.getLogger(__name__)

RENDEZVOUS_VARIABLE = "TORSH_MPI_RENDEZVOUS"
MODES = ("auto", "mpi4py", "env")
_INSTALL = "install mpi4py built against this Open MPI (pip install 'torsh-distributed[mpi]')"
_EXPORT = (
    "export the master to every rank (mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port>)"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MPIRendezvous:
    """Where the job meets, and this rank's connection to it."""

    master_addr: str
    """Host of rank 0's store."""
    master_port: int
    """Port of rank 0's store."""
    method: str
    """``"mpi4py"`` (broadcast over MPI) or ``"env"`` (derived from the environment)."""
    store: dist.Store
    """This rank's store (rank 0 serves it), ready for ``init_process_group(store=...)``."""
    gloo_ifname: str | None = None
    """Interface Gloo should use when the user set none: the loopback one on a single node."""


def rendezvous(info: WorldInfo, env: Mapping[str, str], *, timeout: timedelta) -> MPIRendezvous:
    """Agree on rank 0's store for an ``mpirun`` job whose environment names no master.

    Args:
        info: The layout :class:`~torsh_distributed.runtime.env.MPIEnvironment` read.
        env: The environment (``os.environ`` outside tests).
        timeout: How long a rank waits for the store (and the store for its peers).

    Raises:
        ConfigurationError: several nodes and no mpi4py, ``TORSH_MPI_RENDEZVOUS=mpi4py`` without
            a usable mpi4py, or rank 0 could not serve the store.
        CommunicationError: this rank could not reach rank 0's store.
    """
    mode = env.get(RENDEZVOUS_VARIABLE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigurationError(
            f"{RENDEZVOUS_VARIABLE}={env[RENDEZVOUS_VARIABLE]!r} is not one of {', '.join(MODES)}",
            rank=info.rank,
            operation="init",
        )
    single = MPIEnvironment.single_node(env)
    if mode != "env":
        comm, reason = _comm_world(info)
        if comm is not None:
            return _over_mpi(comm, info, single_node=single, timeout=timeout)
        if mode == "mpi4py":
            raise ConfigurationError(
                f"{RENDEZVOUS_VARIABLE}=mpi4py but {reason}",
                rank=info.rank,
                operation="init",
                fix=f"{_INSTALL}, or unset {RENDEZVOUS_VARIABLE}.",
            )
        if not single:
            raise ConfigurationError(
                f"mpirun started {info.world_size} ranks on several nodes and no MASTER_ADDR is "
                f"set; the rendezvous needs mpi4py there, but {reason}",
                rank=info.rank,
                operation="init",
                fix=f"{_EXPORT}, or {_INSTALL}.",
            )
        if reason != "mpi4py is not installed":
            warnings.warn(
                f"{reason}; deriving the rendezvous from the environment instead",
                RuntimeWarning,
                stacklevel=2,
            )
    elif not single:
        raise ConfigurationError(
            f"{RENDEZVOUS_VARIABLE}=env derives a rendezvous on one node only, but mpirun placed "
            f"the {info.world_size} ranks on several nodes and no MASTER_ADDR is set",
            rank=info.rank,
            operation="init",
            fix=f"{_EXPORT}, or unset {RENDEZVOUS_VARIABLE} and {_INSTALL}.",
        )
    return _from_env(info, env, timeout=timeout)


def _comm_world(info: WorldInfo) -> tuple[Any, str]:
    """mpi4py's ``COMM_WORLD`` if it describes this job, else ``None`` and why not."""
    try:
        from mpi4py import MPI  # initialises MPI
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "mpi4py":
            return None, "mpi4py is not installed"
        return None, f"mpi4py does not import ({exc})"
    except RuntimeError as exc:  # e.g. no MPI library found at run time
        return None, f"mpi4py cannot start MPI ({exc})"
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (info.rank, info.world_size):
        # A wheel that bundles another MPI (MPICH) makes every rank a singleton of one.
        return None, (
            f"mpi4py's MPI.COMM_WORLD is rank {comm.Get_rank()} of {comm.Get_size()}, not rank "
            f"{info.rank} of {info.world_size}: it is built against another MPI than this mpirun"
        )
    return comm, ""


def _over_mpi(
    comm: Any, info: WorldInfo, *, single_node: bool, timeout: timedelta
) -> MPIRendezvous:
    hosts = comm.gather(socket.gethostname(), root=0)  # every rank takes part, whatever happens
    store: dist.Store | None = None
    if info.rank == 0:
        error: Exception | None = None
        try:
            host = "127.0.0.1" if single_node else _address_toward(hosts)
            store, port = _serve(host, info.master_port or 0, info, timeout)
            message: tuple[str, str, int | str | None] = ("ok", host, port)
        except Exception as exc:  # any failure: the others must hear of it, not wait in bcast
            text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            error, message = exc, ("error", text, getattr(exc, "fix", None))
        comm.bcast(message, root=0)
        if error is not None:
            raise error
    else:
        message = comm.bcast(None, root=0)
    status, host, detail = message
    if status != "ok":
        raise ConfigurationError(
            f"rank 0 could not start the rendezvous store: {host}",
            rank=info.rank,
            operation="init",
            fix=str(detail) if detail else None,
        )
    port = int(detail or 0)
    if store is None:
        store = _connect(host, port, info, timeout)
    log.debug("mpi rendezvous over MPI at %s:%d", host, port)
    return MPIRendezvous(
        master_addr=host,
        master_port=port,
        method="mpi4py",
        store=store,
        gloo_ifname=loopback_interface() if single_node else None,
    )


def _from_env(info: WorldInfo, env: Mapping[str, str], *, timeout: timedelta) -> MPIRendezvous:
    port = info.master_port or MPIEnvironment.job_port(env)
    if port is None:
        names = " or ".join(MPIEnvironment.JOB_ID_VARIABLES)
        raise ConfigurationError(
            f"cannot derive a rendezvous port: none of {names} is set",
            rank=info.rank,
            operation="init",
            fix=f"export MASTER_PORT to every rank (mpirun -x MASTER_PORT=<port>), or {_INSTALL}.",
        )
    host = "127.0.0.1"
    if info.rank == 0:
        store, _ = _serve(host, port, info, timeout)
    else:
        store = _connect(host, port, info, timeout)
    # The port is guessable, so a foreign store may sit on it: keep our keys apart from its.
    job = next((env[key] for key in MPIEnvironment.JOB_ID_VARIABLES if env.get(key)), "job")
    log.debug("mpi rendezvous derived from the environment at %s:%d", host, port)
    return MPIRendezvous(
        master_addr=host,
        master_port=port,
        method="env",
        store=dist.PrefixStore(f"torsh-mpi/{job}/", store),
        gloo_ifname=loopback_interface(),
    )


def _serve(host: str, port: int, info: WorldInfo, timeout: timedelta) -> tuple[dist.TCPStore, int]:
    """Rank 0's store on a socket bound to ``host`` only; returns it and the bound port."""
    try:
        addrinfo = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        family, kind, proto, _, sockaddr = addrinfo
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot open a socket on {host}: {exc}", rank=info.rank, operation="init"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(max(128, info.world_size))
        bound = int(sock.getsockname()[1])
    except OSError as exc:
        sock.close()
        raise ConfigurationError(
            f"cannot listen on {host}:{port} for the rendezvous store: {exc.strerror or exc}",
            rank=info.rank,
            operation="init",
            fix="another program holds the port: export MASTER_PORT=<free port> to every rank "
            f"(mpirun -x MASTER_PORT=...), or {_INSTALL} to get a free port.",
        ) from None
    fd = sock.detach()  # the store owns and closes the descriptor from here on
    try:
        store = dist.TCPStore(
            host,
            bound,
            info.world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,  # init_process_group waits for the peers itself
            master_listen_fd=fd,
        )
    except (RuntimeError, OSError) as exc:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise CommunicationError(
            f"cannot serve the rendezvous store on {host}:{bound}: {exc}",
            rank=info.rank,
            operation="init",
        ) from exc
    return store, bound


def _connect(host: str, port: int, info: WorldInfo, timeout: timedelta) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, info.world_size, False, timeout=timeout)
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        raise CommunicationError(
            f"cannot reach rank 0's rendezvous store at {host}:{port}: {str(exc).splitlines()[0]}",
            rank=info.rank,
            operation="init",
            fix="check that rank 0 started and that its address is reachable from this node; "
            "exporting MASTER_ADDR chooses the address.",
        ) from exc


def _address_toward(hosts: list[str]) -> str:
    """The address of this node (rank 0's) on the route toward the first rank on another host.

    Connecting a UDP socket sends nothing: it only asks the kernel which local address it would
    use, which is the interface the other nodes can reach (not ``127.0.1.1``, which a Debian
    host name often resolves to).
    """
    peers = [host for host in dict.fromkeys(hosts) if host != hosts[0]]
    for peer in peers:
        try:
            candidates = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)
        except OSError:
            continue
        for family, kind, proto, _, sockaddr in candidates:
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.connect(sockaddr)
                    addr = str(probe.getsockname()[0])
            except OSError:
                continue
            if not ipaddress.ip_address(addr.split("%")[0]).is_loopback:
                return addr
    raise ConfigurationError(
        f"cannot find this node's address toward the other nodes ({', '.join(peers) or 'none'})",
        operation="init",
        fix=f"{_EXPORT}.",
    )
