"""The parameter server's only contact with the RPC layer: init, call, call_async, shutdown.

Built on ``torch.distributed.rpc`` (TensorPipe) directly; switching to ``torsh_distributed.rpc``
changes this file only. torch.distributed.rpc pickles arguments and results: every peer of a job
must trust every other (see docs/parameter-server.md, "Security").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed.rpc as rpc
from torch.futures import Future

from torsh_distributed.runtime._net import loopback_interface

__all__ = ["init", "call", "call_async", "shutdown", "server_name", "worker_name", "Future"]


def server_name(index: int) -> str:
    """RPC name of server ``index``."""
    return f"ps-server-{index}"


def worker_name(index: int) -> str:
    """RPC name of worker ``index``."""
    return f"ps-worker-{index}"


def init(name: str, *, rank: int, world_size: int, host: str, timeout_s: float, num_threads: int) -> None:
    """Join the job's RPC group as ``name`` (rendezvous: ``MASTER_ADDR``/``MASTER_PORT``, or the
    launcher's agent store under torchrun).

    ``host`` on loopback pins TensorPipe's listening sockets to the loopback interface
    (``TP_SOCKET_IFNAME``) unless the user already chose one.
    """
    if host in ("127.0.0.1", "localhost", "::1"):
        iface = loopback_interface()
        if iface:
            os.environ.setdefault("TP_SOCKET_IFNAME", iface)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_threads, rpc_timeout=timeout_s, init_method="env://"
    )
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def call(to: str, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """Run ``fn(*args)`` on ``to`` and return its result (raises what it raised)."""
    return rpc.rpc_sync(to, fn, args=args, timeout=timeout)


def call_async(to: str, fn: Callable[..., Any], *args: Any, timeout: float) -> Future[Any]:
    """Start ``fn(*args)`` on ``to``; ``.wait()`` the returned future for its result."""
    return rpc.rpc_async(to, fn, args=args, timeout=timeout)


def shutdown(*, graceful: bool = True) -> None:
    """Leave the RPC group; graceful waits until every peer has finished its outstanding work
    (servers call it right after :func:`init` and serve until the workers are done)."""
    rpc.shutdown(graceful=graceful)
