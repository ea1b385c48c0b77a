"""Natural compression (Horváth et al. 2019, "Natural Compression for Distributed Deep Learning").

Every entry is rounded *stochastically* to one of the two powers of two around it: for
``2^a <= |x| < 2^(a+1)`` the result is ``sign(x) 2^(a+1)`` with probability ``|x| / 2^a - 1`` and
``sign(x) 2^a`` otherwise. The estimate is unbiased (``E C(x) = x``) and its variance is at most
``||x||^2 / 8`` (the paper's Theorem 1: ``omega = 1/8``), with no scale to choose: only the sign
and the exponent travel.

Encoding: one byte per entry (bit 7 the sign, bits 0-6 the exponent relative to the bucket's
largest, 0 meaning zero) plus one int32 per bucket (the largest exponent), so 4x fewer bytes than
fp32 at two ranks, like int8, but unbiased and with a relative error independent of the spread of
magnitudes in the bucket. Entries more than 2^126 below the bucket's largest (fp32 denormals at
gradient scales) round stochastically to zero or to the smallest code, which keeps them unbiased.
Each rank's exponent base differs, so payloads are all-gathered.
"""

from __future__ import annotations

from typing import Any

import torch

from torsh_distributed.compression._rng import Stream
from torsh_distributed.compression.base import Compressor, Payload

__all__ = ["Natural", "natural_round"]

_SPAN = 127  # exponent codes 1..127; 0 encodes zero


def natural_round(
    x: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased rounding of ``x`` to signed powers of two: ``(negative, exponent)`` with
    ``|C(x)| = 2^exponent`` where ``x != 0`` (``exponent`` is meaningless where ``x == 0``).

    Read from fp32's bits (integer operations, 2-3x faster than ``frexp`` and float draws): a
    normal ``|x| = (1 + m / 2^23) 2^(e - 127)`` rounds up with probability ``m / 2^23``, drawn as
    ``randint(2^23) < m``. Denormals (rare) take ``frexp``."""
    bits = x.float().contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    draws = torch.randint(
        0, 1 << 23, x.shape, generator=generator, dtype=torch.int32, device=generator.device
    )
    up = draws.to(x.device) < mantissa  # drawn on the bucket's device where it has a generator
    exponent = biased - 127 + up.to(torch.int32)
    denormal = (biased == 0) & (mantissa != 0)
    if bool(denormal.any()):
        m, e = torch.frexp(x.float()[denormal].abs())  # |x| = m 2^e, m in [0.5, 1)
        u = torch.rand(m.shape, generator=generator, device=generator.device).to(x.device)
        exponent[denormal] = e.to(torch.int32) - 1 + (u < 2.0 * m - 1.0).to(torch.int32)
    return bits < 0, exponent


class Natural(Compressor):
    """Stochastic rounding to powers of two; see the module docstring.

    Unbiased, so error feedback is off by default (the paper uses none).

    Args:
        seed: Seed of the rounding draws (deterministic given the seed; ranks may share it:
            each rank rounds its own gradient).
    """

    summable = False

    def __init__(self, *, seed: int = 0) -> None:
        self.stream = Stream(seed)
        self.name = "natural"

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        g = self.stream.next(key, flat.device)
        negative, exponent = natural_round(flat, g)
        nonzero = flat != 0
        # zeros read as exponent -127, below every normal entry's: the max is the largest
        # entry's (or -127, which still gives every denormal a code >= 105)
        top = int(exponent.max()) if flat.numel() else 0
        base = top - _SPAN  # code k stands for 2^(base + k)
        code = exponent - base
        # below the smallest code: round to 0 or 2^(base + 1), keeping the mean
        low = nonzero & (code < 1)
        if bool(low.any()):
            smallest = torch.ldexp(flat.new_ones((), dtype=torch.float32),
                                   torch.tensor(base + 1, device=flat.device))
            u = torch.rand(flat.shape, generator=g, device=g.device).to(flat.device)
            keep = u < flat.abs() / smallest
            code = torch.where(low, keep.to(torch.int32), code)
        code = torch.where(nonzero, code, torch.zeros_like(code))
        packed = code.to(torch.uint8) | (negative & (code > 0)).to(torch.uint8) << 7
        return [packed, torch.tensor([base], dtype=torch.int32, device=flat.device)], flat.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        packed, base = payload
        code = (packed & 0x7F).to(torch.int32)
        offset = int(base[0]) + 127
        biased = code + offset
        used = code > 0
        lowest = int(torch.where(used, code, 127).min()) if code.numel() else 127
        highest = int(code.max()) if code.numel() else 0
        if lowest + offset < 1 or highest + offset > 254:  # outside fp32's normal range
            magnitude = torch.ldexp(torch.ones(code.shape, device=code.device), (biased - 127).float())
            sign = 1.0 - 2.0 * (packed >> 7).float()
            out = torch.where(used, magnitude * sign, torch.zeros_like(magnitude))
        else:  # build the fp32 bits: sign, exponent, zero mantissa
            bits = (biased << 23) | ((packed >> 7).to(torch.int32) << 31)
            out = torch.where(used, bits, torch.zeros_like(bits)).view(torch.float32)
        return out.to(ctx or torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
