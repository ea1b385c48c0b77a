"""Sparsifiers: TopK, RandomK and threshold. They send (index, value) pairs.

TopK's and the threshold's indices differ between ranks, so their pairs are all-gathered and
scattered into a dense sum (never all-reduced). RandomK draws the same indices on every rank
(a shared seed and per-bucket counter), so its values alone are all-reduced.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torsh_distributed.compression._rng import Stream
from torsh_distributed.compression.base import Comm, Compressor, Payload, Timer

__all__ = ["TopK", "RandomK", "Threshold", "check_ratio", "top_indices"]


_RANDPERM_MAX = 1 << 22


def check_ratio(ratio: float, name: str) -> float:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name} ratio must be in (0, 1], got {ratio}")
    return ratio


def _k(n: int, ratio: float) -> int:
    return min(n, max(1, math.ceil(ratio * n)))


def _scatter(n: int, idx: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(n, dtype=dtype, device=values.device)
    out[idx.long()] = values.to(dtype)
    return out


def _gather_sum(payload: Payload, ctx: Any, comm: Comm, timer: Timer) -> torch.Tensor:
    gathered = comm.all_gather(payload)
    with timer.decompress:
        n, dtype = ctx[0], ctx[1]
        out = torch.zeros(n, dtype=dtype, device=gathered[0][1].device)
        for idx, values in gathered:  # index_add sums pairs of different ranks at one index
            out.index_add_(0, idx.long(), values.to(dtype))
        return out.div_(comm.world_size)


class _Sparse(Compressor):
    """Shared decode and gather-combine of index/value payloads."""

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        idx, values = payload
        return _scatter(ctx[0], idx, values, ctx[1])

    def exchange(self, payload: Payload, ctx: Any, comm: Comm, timer: Timer) -> torch.Tensor:
        return _gather_sum(payload, ctx, comm, timer)

    def unsent(self, tensor: torch.Tensor, payload: Payload, ctx: Any) -> torch.Tensor:
        idx, values = payload  # values are copies of tensor's entries: the result is exact
        flat = tensor.reshape(-1)
        flat[idx.long()] -= values.to(flat.dtype)
        return tensor


class TopK(_Sparse):
    """Keep the ``ratio`` fraction of entries largest in magnitude (Aji & Heafield 2017; Lin et al.
    2018). Biased: use with error feedback (the default). Sends ``k`` int32 indices and ``k``
    fp32 values: at 1 % that is 8 % of the dense bytes at two ranks.

    Args:
        ratio: Fraction of entries kept, in (0, 1].
    """

    def __init__(self, ratio: float) -> None:
        self.ratio = check_ratio(ratio, "topk")
        self.name = f"topk:{ratio:g}"

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        idx = top_indices(flat.abs(), _k(flat.numel(), self.ratio))
        return [idx.to(torch.int32), flat[idx]], (flat.numel(), flat.dtype)


_SAMPLE = 1 << 16  # entries sampled to estimate the threshold of large buckets


def top_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of ``magnitude`` (any order): exactly ``torch.topk``'s
    set, faster on large vectors.

    ``torch.topk`` over millions of entries costs more on a CPU than a slow link saves. As in
    Deep Gradient Compression, a threshold is estimated from an evenly strided sample (the
    quantile that should keep about ``2k`` entries), the entries at or above it are selected,
    and ``topk`` runs on those candidates only. Every entry of the true top-k is at least the
    k-th largest, so if at least ``k`` candidates pass, the true top-k is among them and the
    result is exact; otherwise (a sample that overestimated) it falls back to ``topk`` on all.
    """
    n = magnitude.numel()
    if n <= 4 * _SAMPLE or 4 * k >= n:
        return torch.topk(magnitude, k, sorted=False).indices
    sample = magnitude[:: n // _SAMPLE]
    keep = min(sample.numel(), max(1, (2 * k * sample.numel()) // n))
    threshold = torch.topk(sample, keep, sorted=False).values.min()
    candidates = torch.nonzero(magnitude >= threshold).reshape(-1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


class Threshold(_Sparse):
    """Send every entry with ``|x| >= threshold`` (Strom 2015). The count varies per rank and step:
    counts are exchanged first and the pairs padded to the largest count (the padding is sent
    and counted). Biased: use with error feedback (the default).

    Args:
        threshold: Magnitude threshold, > 0.
    """

    def __init__(self, threshold: float) -> None:
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        self.threshold = threshold
        self.name = f"threshold:{threshold:g}"

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        idx = torch.nonzero(flat.abs() >= self.threshold).reshape(-1)
        return [idx.to(torch.int32), flat[idx]], (flat.numel(), flat.dtype)

    def exchange(self, payload: Payload, ctx: Any, comm: Comm, timer: Timer) -> torch.Tensor:
        idx, values = payload
        counts = comm.all_gather([torch.tensor([idx.numel()], dtype=torch.int64, device=idx.device)])
        width = max(int(c[0].item()) for c in counts)
        pad = width - idx.numel()
        # padding points at index 0 with value 0: adding it changes nothing
        idx = torch.cat([idx, idx.new_zeros(pad)])
        values = torch.cat([values, values.new_zeros(pad)])
        return _gather_sum([idx, values], ctx, comm, timer)


class RandomK(Compressor):
    """Keep ``k`` entries drawn at random, the same on every rank, so values are all-reduced.

    Indices are ``k`` distinct entries (a seeded ``randperm``) for buckets up to 2^22 entries;
    above that they are drawn with replacement (``randint``), so slightly fewer than ``k``
    distinct entries are sent. Not rescaled (biased toward zero): use with error feedback
    (the default).

    Args:
        ratio: Fraction of entries drawn, in (0, 1].
        seed: Shared seed; all ranks must use the same.
    """

    summable = True

    def __init__(self, ratio: float, *, seed: int = 0) -> None:
        self.ratio = check_ratio(ratio, "randomk")
        self.stream = Stream(seed)
        self.name = f"randomk:{ratio:g}"

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k, g = _k(n, self.ratio), self.stream.next(key)
        if n <= _RANDPERM_MAX:
            idx = torch.randperm(n, generator=g)[:k]  # k distinct entries
        else:  # a permutation of a huge bucket costs more than the exchange saves
            idx = torch.randint(0, n, (k,), generator=g)
        return [flat[idx]], (n, flat.dtype, idx)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        n, dtype, idx = ctx
        return _scatter(n, idx, payload[0], dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
