"""Bytes between ranks for peer-replicated checkpoints: raw ``uint8`` tensors on a Gloo group.

Nothing here interprets what it moves: file contents travel as they lie on disk (DCP shards, JSON)
and are checked against SHA-256 digests by the caller; control messages are JSON. Nothing is
pickled (``all_gather_object`` would unpickle a peer's bytes), so a peer can send us nothing but
data. Every function is collective or paired exactly as its docstring says.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_json",
    "broadcast_bytes",
    "exchange",
    "recv_bytes",
    "send_bytes",
    "to_tensor",
]


def to_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A ``uint8`` tensor over ``data`` (copied once; an empty payload is a 0-length tensor)."""
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def all_gather_json(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order. Collective on ``group``."""
    payload = json.dumps(value, sort_keys=True).encode()
    world = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = to_tensor(payload)
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [
        json.loads(bytes(t[: int(n.item())].numpy()).decode())
        for t, n in zip(gathered, lengths, strict=True)
    ]


def broadcast_bytes(data: bytes | None, *, src: int, group: dist.ProcessGroup) -> bytes:
    """``src``'s ``data`` on every rank (others pass ``None``). Collective on ``group``;
    ``src`` is a global rank."""
    is_src = dist.get_rank() == src
    length = torch.tensor([len(data) if is_src and data is not None else 0], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    size = int(length.item())
    buffer = to_tensor(data or b"") if is_src else torch.empty(size, dtype=torch.uint8)
    if size:
        dist.broadcast(buffer, src=src, group=group)
    return bytes(buffer.numpy()) if size else b""


def send_bytes(data: bytes, *, dst: int, group: dist.ProcessGroup) -> None:
    """Send ``data`` to global rank ``dst``, which calls :func:`recv_bytes` with our rank."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
    if data:
        dist.send(to_tensor(data), dst=dst, group=group)


def recv_bytes(*, src: int, group: dist.ProcessGroup) -> bytes:
    """Receive what global rank ``src`` sends with :func:`send_bytes`."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src=src, group=group)
    size = int(length.item())
    if not size:
        return b""
    buffer = torch.empty(size, dtype=torch.uint8)
    dist.recv(buffer, src=src, group=group)
    return bytes(buffer.numpy())


def exchange(
    sends: dict[int, bytes], sources: list[int], *, group: dist.ProcessGroup
) -> dict[int, bytes]:
    """Send ``sends[dst]`` to each ``dst`` and receive one payload from each of ``sources``, all
    at once (non-blocking pairs, so a ring of ranks cannot deadlock). Every ``dst`` must list
    us among its ``sources``."""
    lengths = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
    works = [dist.irecv(n, src=src, group=group) for src, n in lengths.items()]
    works += [
        dist.isend(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
        for dst, data in sends.items()
    ]
    for work in works:
        work.wait()
    buffers = {src: torch.empty(int(n.item()), dtype=torch.uint8) for src, n in lengths.items()}
    works = [dist.irecv(buf, src=src, group=group) for src, buf in buffers.items() if buf.numel()]
    payloads = {dst: to_tensor(data) for dst, data in sends.items()}
    works += [
        dist.isend(tensor, dst=dst, group=group)
        for dst, tensor in payloads.items()
        if tensor.numel()
    ]
    for work in works:
        work.wait()
    return {src: bytes(buf.numpy()) for src, buf in buffers.items()}
