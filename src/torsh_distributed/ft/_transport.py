"""Live state between replica groups without pickle: a JSON header plus raw tensor bytes.

torchft's own transports unpickle what a peer sends (``HTTPTransport`` loads with
``weights_only=False``; ``PGTransport`` pickles its metadata). :class:`StoreTransport` moves the
same state dict through the job's TCP store instead: nested dicts and lists of tensors, numbers,
strings and ``None`` become one JSON header and one byte string per tensor, decoded with
``torch.frombuffer`` (nothing is executed on load). The store lives in the launcher, so a state
is readable while the group that wrote it is alive, over the network, with no disk read.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft.checkpointing.transport import CheckpointTransport

__all__ = ["StoreTransport", "decode", "encode"]

_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def encode(tree: Any) -> tuple[bytes, list[bytes]]:
    """``tree`` as a JSON header and the tensors' bytes (``TypeError`` on anything else)."""
    blobs: list[bytes] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            t = node.detach().to("cpu").contiguous()
            if str(t.dtype) not in _DTYPES:
                raise TypeError(f"cannot send a tensor of dtype {t.dtype}")
            blobs.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return {"__tensor__": len(blobs) - 1, "dtype": str(t.dtype), "shape": list(t.shape)}
        if isinstance(node, dict):
            if not all(isinstance(k, (str, int)) for k in node):
                raise TypeError("state dict keys must be str or int")
            return {"__dict__": [[k, walk(v)] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return {"__list__": [walk(v) for v in node]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"cannot send a {type(node).__name__} in a replica's state")

    return json.dumps(walk(tree)).encode(), blobs


def decode(header: bytes, blobs: list[bytes]) -> Any:
    """Inverse of :func:`encode` (tensors are fresh CPU tensors)."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "__tensor__" in node:
                dtype = _DTYPES[node["dtype"]]
                shape = node["shape"]
                raw = blobs[node["__tensor__"]]
                if not raw:
                    return torch.empty(shape, dtype=dtype)
                flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                return flat.view(dtype).reshape(shape)
            if "__dict__" in node:
                return {k: walk(v) for k, v in node["__dict__"]}
            return [walk(v) for v in node["__list__"]]
        return node

    return walk(json.loads(header))


class StoreTransport(CheckpointTransport[Any]):
    """torchft checkpoint transport through a TCP store (see the module doc).

    Args:
        store: The job's store (the launcher's), reachable from every group.
        key: This rank's slot: the replica group's id and the rank in its group; a healing rank
            reads the slot of the same group rank of its source group.
        timeout: How long a reader waits for the state.
    """

    def __init__(self, store: dist.Store, *, key: str, timeout: timedelta) -> None:
        self._store, self._key, self._timeout = store, key, timeout
        self.bytes_sent = 0

    def metadata(self) -> str:
        return self._key

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        header, blobs = encode(state_dict)
        prefix = f"{self._key}/{step}"
        for i, blob in enumerate(blobs):
            self._store.set(f"{prefix}/t{i}", blob)
        self._store.set(f"{prefix}/n", str(len(blobs)))
        self._store.set(f"{prefix}/h", header)  # last: a reader that sees it sees every tensor
        self.bytes_sent += len(header) + sum(len(b) for b in blobs)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        prefix = f"{metadata}/{step}"
        self._store.set_timeout(timeout)
        header = self._store.get(f"{prefix}/h")
        count = int(self._store.get(f"{prefix}/n"))
        return decode(header, [self._store.get(f"{prefix}/t{i}") for i in range(count)])

    def disallow_checkpoint(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass
