"""Lossless compression of a payload's bytes with Zstandard, stacked after any gathered method.

``zstd:<spec>`` runs the inner method (``int8``, ``topk:0.01``, ``sign``, ...; with its own error
feedback inside), serialises its payload tensors (a small header of dtype and length per
tensor, then the raw bytes) and compresses the stream with ``zstandard`` (the maintained binding
of Facebook's zstd). Decoding restores the inner payload bit for bit, so the result is exactly
the inner method's: only the bytes on the wire change. Streams differ in length per rank, so the
lengths are gathered first and the streams padded to the longest (the padding is sent and
counted, as for ``threshold``).

What it gains depends on the inner payload's entropy: fp32 gradient values have nearly random
low mantissa bits (a few percent), while int8 codes, sign bits and sorted sparse indices of a
trained model's gradients compress further (docs/compression.md has the measured ratios). The
price is CPU time on both sides: ``auto:zstd`` lets the cost model decide per bucket whether a
link is slow enough to pay it.
"""

from __future__ import annotations

from typing import Any

import torch

from torsh_distributed.compression.base import Comm, Compressor, Payload, Timer

__all__ = ["Zstd", "encode", "decode"]

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float64,
    torch.bool,
]


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - an install without the extra
        raise ValueError(
            "compression zstd:<spec> needs the zstandard package: "
            "pip install 'torsh-distributed[compression]'"
        ) from None
    return zstandard


def encode(payload: Payload) -> bytes:
    """The tensors of ``payload`` as one byte stream: ``count``, then ``(dtype, numel)`` per tensor
    (int64), then every tensor's raw bytes."""
    header = [len(payload)]
    for t in payload:
        header += [_DTYPES.index(t.dtype), t.numel()]
    parts = [torch.tensor(header, dtype=torch.int64).numpy().tobytes()]
    for t in payload:
        parts.append(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def decode(stream: bytes) -> Payload:
    """Inverse of :func:`encode` (every tensor flat)."""
    raw = bytearray(stream)  # writable, so frombuffer shares it without a warning
    count = int(torch.frombuffer(raw, dtype=torch.int64, count=1)[0])
    header = torch.frombuffer(raw, dtype=torch.int64, count=1 + 2 * count).tolist()
    offset = 8 * (1 + 2 * count)
    out: Payload = []
    for i in range(count):
        dtype, numel = _DTYPES[header[1 + 2 * i]], header[2 + 2 * i]
        size = numel * torch.empty((), dtype=dtype).element_size()
        chunk = torch.frombuffer(raw, dtype=torch.uint8, count=size, offset=offset) if size else (
            torch.empty(0, dtype=torch.uint8)
        )
        out.append(chunk.clone().view(dtype))
        offset += size
    return out


class Zstd(Compressor):
    """A lossless stage after ``inner``; see the module docstring.

    Args:
        inner: The (lossy or not) method whose payload is compressed; must exchange through
            ``compress``/``exchange`` (not PowerSGD, EF21, sketch or ``auto``, which run their own
            rounds).
        level: Zstandard level (1 fastest .. 22 smallest); 1-3 suit gradients (more buys
            little on near-random bytes and costs much more time).
    """

    summable = False

    def __init__(self, inner: Compressor, *, level: int = 3) -> None:
        if not 1 <= level <= 22:
            raise ValueError(f"zstd level must be in 1..22, got {level}")
        zstandard = _zstd()
        self.inner, self.level = inner, level
        self.name = f"zstd:{inner.name}"
        self._c = zstandard.ZstdCompressor(level=level)
        self._d = zstandard.ZstdDecompressor()
        self.raw_bytes = 0
        """Bytes of the inner payloads this rank compressed (the ratio's numerator)."""
        self.packed_bytes = 0
        """Bytes of the compressed streams (before padding)."""

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        payload, ctx = self.inner.compress(tensor, key=key)
        raw = encode(payload)
        packed = self._c.compress(raw)
        self.raw_bytes += len(raw)
        self.packed_bytes += len(packed)
        return [torch.frombuffer(bytearray(packed), dtype=torch.uint8)], ctx

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        stream = self._d.decompress(payload[0].numpy().tobytes())
        return self.inner.decompress(decode(stream), ctx)

    def combine(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        return self.inner.combine(decoded)

    def exchange(self, payload: Payload, ctx: Any, comm: Comm, timer: Timer) -> torch.Tensor:
        stream = payload[0]
        lengths = comm.all_gather([torch.tensor([stream.numel()], dtype=torch.int64, device=stream.device)])
        sizes = [int(x[0][0]) for x in lengths]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: stream.numel()] = stream
        gathered = comm.all_gather([padded])
        with timer.decompress:
            return self.combine(
                [self.decompress([g[0][:s]], ctx) for g, s in zip(gathered, sizes, strict=True)]
            )

    def unsent(self, tensor: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        return tensor - self.decompress(payload, ctx)

    def take_residual(self, key: int) -> torch.Tensor | None:
        return self.inner.take_residual(key)

    def reset_errors(self) -> None:
        self.inner.reset_errors()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"Zstd({self.inner!r}, level={self.level})"
