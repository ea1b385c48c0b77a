"""Remote calls and references between the workers of one job, on torch.distributed.rpc.

A small, typed layer over torch's TensorPipe agent: rendezvous through our stores (TCP bound to
one address, file, Redis), loopback by default, a token when exposed, a timeout on every call,
typed errors naming the peer and the function, functions callable by registered name, explicit
release of remote references, and a shutdown that ends in bounded time when a peer is dead.
See docs/rpc.md.
"""

from torsh_distributed.rpc.agent import (
    RPCContext,
    current,
    init,
    is_initialized,
    shutdown,
    worker_names,
)
from torsh_distributed.rpc.api import Future, RemoteRef, remote, rpc_async, rpc_sync
from torsh_distributed.rpc.config import RPCConfig
from torsh_distributed.rpc.errors import (
    PeerUnavailableError,
    RemoteError,
    RemoteRefReleasedError,
    RPCError,
    RPCTimeoutError,
    UnknownFunctionError,
)
from torsh_distributed.rpc.registry import register, registered_names, unregister

__all__ = [
    "Future",
    "PeerUnavailableError",
    "RPCConfig",
    "RPCContext",
    "RPCError",
    "RPCTimeoutError",
    "RemoteError",
    "RemoteRef",
    "RemoteRefReleasedError",
    "UnknownFunctionError",
    "current",
    "init",
    "is_initialized",
    "register",
    "registered_names",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "unregister",
    "worker_names",
]
