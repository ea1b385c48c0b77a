"""Which server owns what: dense keys by a stable hash of their name, embedding rows by row id
(modulo the number of servers, or contiguous ranges).

Pure functions shared by the client (to split a push) and the server (to map global row ids to
its local rows), so both sides always agree.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

__all__ = ["TableSpec", "server_of_key", "split_rows", "local_rows", "num_local_rows"]

PARTITIONS = ("mod", "range")


@dataclass(frozen=True, kw_only=True, slots=True)
class TableSpec:
    """A sparse embedding table held by rows across the servers."""

    num_rows: int
    """Rows of the whole table."""
    dim: int
    """Width of a row."""
    partition: str = "mod"
    """``mod``: row r lives on server r % S (spreads hot low ids); ``range``: server k holds a
    contiguous block of ceil(num_rows / S) rows (keeps neighbouring ids together)."""

    def __post_init__(self) -> None:
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.num_rows < 1 or self.dim < 1:
            raise ValueError(f"num_rows and dim must be >= 1, got {self.num_rows}, {self.dim}")


def server_of_key(key: str, num_servers: int) -> int:
    """Server of a dense key: CRC-32 of its name modulo ``num_servers`` (stable across processes,
    unlike ``hash()``)."""
    return zlib.crc32(key.encode()) % num_servers


def _block(spec: TableSpec, num_servers: int) -> int:
    return -(-spec.num_rows // num_servers)


def owner_of_rows(ids: torch.Tensor, spec: TableSpec, num_servers: int) -> torch.Tensor:
    """Server of each global row id."""
    if spec.partition == "mod":
        return ids % num_servers
    return ids // _block(spec, num_servers)


def split_rows(ids: torch.Tensor, spec: TableSpec, num_servers: int) -> list[torch.Tensor]:
    """For each server, the positions in ``ids`` of the rows it owns."""
    owner = owner_of_rows(ids, spec, num_servers)
    return [torch.nonzero(owner == k, as_tuple=True)[0] for k in range(num_servers)]


def local_rows(ids: torch.Tensor, spec: TableSpec, num_servers: int) -> torch.Tensor:
    """Local index, on their owner, of global row ids."""
    if spec.partition == "mod":
        return ids // num_servers
    return ids % _block(spec, num_servers)


def num_local_rows(spec: TableSpec, server: int, num_servers: int) -> int:
    """How many rows of the table ``server`` holds."""
    if spec.partition == "mod":
        return len(range(server, spec.num_rows, num_servers))
    block = _block(spec, num_servers)
    return max(0, min(spec.num_rows, (server + 1) * block) - server * block)


def global_rows(spec: TableSpec, server: int, num_servers: int) -> torch.Tensor:
    """Global ids of the rows ``server`` holds, in local order."""
    if spec.partition == "mod":
        return torch.arange(server, spec.num_rows, num_servers)
    block = _block(spec, num_servers)
    return torch.arange(server * block, min(spec.num_rows, (server + 1) * block))
