"""Pack small integer codes (1 or 2 bits each) into bytes and back."""

from __future__ import annotations

import torch

__all__ = ["pack", "unpack"]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8 values below ``2**bits``) -> ``ceil(n * bits / 8)`` bytes."""
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes.reshape(-1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (padded.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.view(-1, 1) >> shifts) & mask).reshape(-1)[:n]
