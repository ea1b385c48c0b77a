"""Quantizers: fp16 and bf16 casts (summable) and int8 with a per-bucket scale (gathered)."""

from __future__ import annotations

from typing import Any

import torch

from torsh_distributed.compression._rng import Stream
from torsh_distributed.compression.base import Compressor, Payload

__all__ = ["Cast", "Int8"]

_FP16_MAX = 65504.0


class Cast(Compressor):
    """Send the bucket in a 16-bit float type; sums of casts are casts of sums, so all-reduced.

    fp16 keeps 10 mantissa bits but overflows above 65504 (values are clamped, never inf);
    bf16 keeps fp32's range with 7 mantissa bits. The relative error is at most 2^-11 (fp16,
    normal range) or 2^-8 (bf16). The all-reduce itself also sums in 16 bits.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    summable = True

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Cast dtype must be float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        if self.dtype == torch.float16:
            tensor = tensor.clamp(-_FP16_MAX, _FP16_MAX)
        return [tensor.to(self.dtype)], tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0].to(ctx or torch.float32)


class Int8(Compressor):
    """Uniform 8-bit quantization with one fp32 scale per bucket (``scale = max|x| / 127``).

    Each rank's scale differs, so int8 codes of different ranks cannot be summed: payloads
    are all-gathered (4x fewer bytes than fp32 at two ranks; at ``w`` ranks an all-gather sends
    ``(w - 1) n`` bytes against the fp32 all-reduce's ``8 (w - 1) / w n``).

    Args:
        stochastic: Stochastic rounding (``floor(x / scale + u)``, ``u ~ U[0, 1)``): unbiased,
            error below one step; deterministic rounding has half that error but is biased.
        seed: Seed of the rounding noise (deterministic given the seed).
    """

    summable = False

    def __init__(self, *, stochastic: bool = False, seed: int = 0) -> None:
        self.stochastic = stochastic
        self.stream = Stream(seed)
        self.name = "int8"

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        amax = tensor.abs().max() if tensor.numel() else tensor.new_zeros(())
        scale = (amax / 127.0).clamp_min(torch.finfo(torch.float32).tiny).reshape(1).float()
        scaled = tensor / scale
        if self.stochastic:
            g = self.stream.next(key, tensor.device)
            noise = torch.rand(tensor.shape, generator=g, dtype=tensor.dtype, device=g.device)
            noise = noise.to(tensor.device)  # on the tensor's device where it has a generator
            codes = torch.floor(scaled + noise)
        else:
            codes = torch.round(scaled)
        return [codes.clamp_(-127, 127).to(torch.int8), scale], tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        codes, scale = payload
        return codes.to(ctx or torch.float32) * scale

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()} if self.stochastic else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stream" in state:
            self.stream.load_state_dict(state["stream"])
