"""One- and two-bit methods: SignSGD (scaled sign or majority vote) and TernGrad (ternary).

Both pack their codes into bytes (8 signs or 4 ternary codes per byte) plus one fp32 scale per
block of 256 entries; codes of different ranks carry different scales, so payloads are all-gathered.
"""

from __future__ import annotations

from typing import Any

import torch

from torsh_distributed.compression._bits import pack, unpack
from torsh_distributed.compression._rng import Stream
from torsh_distributed.compression.base import Compressor, Payload

__all__ = ["SignSGD", "Ternary"]


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, as ``(num_blocks, block)``."""
    pad = (-flat.numel()) % block
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


class SignSGD(Compressor):
    """Send the sign of every entry, 1 bit each.

    ``vote=False`` (scaled sign, Karimireddy et al. 2019): decode to ``scale * sign`` with
    ``scale = mean |x|`` and average the ranks; biased, so error feedback is on by default.
    ``vote=True`` (majority vote, Bernstein et al. 2018): the update is the sign of the sum of
    the ranks' signs times the mean scale; the vote is not a mean of decodings, which is why it
    combines gathered payloads itself. The original vote has no error feedback (off by default).

    The scale is one fp32 per ``block`` entries (the mean ``|x|`` of that block): a single
    scale per bucket lets the layers with the largest gradients set the step of all others;
    per block it costs 32 / block bits per entry.

    Args:
        vote: Majority vote instead of the average of scaled signs.
        block: Entries per scale (>= 1).
    """

    summable = False

    def __init__(self, *, vote: bool = False, block: int = 256) -> None:
        if block < 1:
            raise ValueError(f"sign block must be >= 1, got {block}")
        self.vote = vote
        self.block = block
        self.name = "sign:vote" if vote else "sign"

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        blocks = _blocks(flat, self.block)
        # mean |x| over the real entries of each block (the padding of the last one excluded)
        counts = torch.full((blocks.shape[0],), float(self.block), device=flat.device)
        counts[-1] = flat.numel() - self.block * (blocks.shape[0] - 1)
        scale = blocks.abs().sum(dim=1) / counts
        bits = pack((flat >= 0).to(torch.uint8), 1)
        return [bits, scale.float()], (flat.numel(), flat.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        bits, scale = payload
        n, dtype = ctx
        signs = unpack(bits, 1, n).to(dtype).mul_(2).sub_(1)
        return signs.mul_(scale.to(dtype).repeat_interleave(self.block)[:n])

    def combine(self, decoded: list[torch.Tensor]) -> torch.Tensor:
        if not self.vote:
            return super().combine(decoded)
        votes = torch.zeros_like(decoded[0])
        scale = 0.0
        for d in decoded:
            votes += torch.sign(d)
            scale += float(d.abs().mean()) if d.numel() else 0.0
        return torch.sign(votes).mul_(scale / len(decoded))


class Ternary(Compressor):
    """TernGrad (Wen et al. 2017): each entry becomes ``s * sign(x) * b`` with ``s = max |x|`` and
    ``b ~ Bernoulli(|x| / s)``: unbiased, 2 bits per entry, error per entry below ``s``.
    Unbiased, so error feedback is off by default (the paper uses none). ``s`` is taken per
    ``block`` entries (the paper's per-layer scaling, without needing layer boundaries): one
    scale per bucket makes the variance of small-gradient layers explode.

    Args:
        seed: Seed of the Bernoulli draws (deterministic given the seed).
        block: Entries per scale (>= 1).
    """

    summable = False

    def __init__(self, *, seed: int = 0, block: int = 256) -> None:
        if block < 1:
            raise ValueError(f"ternary block must be >= 1, got {block}")
        self.stream = Stream(seed)
        self.block = block
        self.name = "ternary"

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        s = _blocks(flat, self.block).abs().amax(dim=1).float()
        prob = (
            flat.abs()
            / s.clamp_min(torch.finfo(torch.float32).tiny).repeat_interleave(self.block)[
                : flat.numel()
            ]
        )
        g = self.stream.next(key, flat.device)
        draws = torch.rand(flat.shape, generator=g, dtype=flat.dtype, device=g.device)
        keep = draws.to(flat.device) < prob  # drawn on the bucket's device where it has a generator
        codes = keep.to(torch.uint8) * torch.where(flat >= 0, 1, 2).to(torch.uint8)
        return [pack(codes, 2), s], (flat.numel(), flat.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        packed, s = payload
        n, dtype = ctx
        codes = unpack(packed, 2, n)
        values = (codes == 1).to(dtype) - (codes == 2).to(dtype)
        return values.mul_(s.to(dtype).repeat_interleave(self.block)[:n])

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
