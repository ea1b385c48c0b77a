"""Tensor partitioning for the priority exchange (private, torch-free).

Parameters in forward order are cut and merged into chunks of about ``partition`` elements,
ByteScheduler's tensor partitioning: a tensor of at least ``partition`` elements is cut into
``partition``-sized pieces (its last piece may share a chunk with the next small tensors);
small tensors are merged until the chunk is full. The chunk index is the priority (0 = the
first parameters the forward reads = sent first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ChunkLayout", "Piece", "plan_chunks"]


@dataclass(frozen=True, slots=True)
class Piece:
    """``length`` elements of parameter ``param`` from flat index ``start``, at ``offset`` in
    its chunk's buffer."""

    param: int
    start: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Chunks (lists of pieces) in priority order, their sizes, and each parameter's chunks."""

    chunks: tuple[tuple[Piece, ...], ...]
    sizes: tuple[int, ...]
    of_param: tuple[tuple[int, ...], ...]
    partition: int

    def __len__(self) -> int:
        return len(self.chunks)


def plan_chunks(numels: Sequence[int], partition: int) -> ChunkLayout:
    """Partition parameters of ``numels`` elements (forward order) into chunks of at most
    ``partition`` elements; parameters of 0 elements belong to no chunk."""
    if partition < 1:
        raise ValueError(f"partition must be >= 1 element, got {partition}")
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, numel in enumerate(numels):
        start = 0
        while start < numel:
            if used == partition or (
                used and numel - start > partition - used and numel >= partition
            ):
                # full, or a big tensor that would straddle: start a chunk on its boundary
                chunks.append(current)
                current, used = [], 0
            if numel - start > partition - used and used:
                chunks.append(current)  # a small tensor that does not fit: next chunk
                current, used = [], 0
            length = min(numel - start, partition - used)
            current.append(Piece(param=index, start=start, offset=used, length=length))
            used += length
            start += length
    if current:
        chunks.append(current)
    of_param: list[list[int]] = [[] for _ in numels]
    for c, pieces in enumerate(chunks):
        for piece in pieces:
            of_param[piece.param].append(c)
    return ChunkLayout(
        chunks=tuple(tuple(c) for c in chunks),
        sizes=tuple(sum(p.length for p in c) for c in chunks),
        of_param=tuple(tuple(c) for c in of_param),
        partition=partition,
    )
