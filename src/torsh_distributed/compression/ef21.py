"""EF21 (Richtarik, Sokolov & Fatkhullin 2021): send compressed *changes* of a gradient estimate.

Every rank keeps an estimate ``g_i`` of its gradient and every rank keeps the same global
estimate ``g = mean_i g_i``. Each step rank ``i`` sends ``c_i = C(grad_i - g_i)`` and sets
``g_i += c_i``; all ranks set ``g += mean_i c_i`` and step with ``g``. With a contractive ``C``
(TopK) ``g_i`` tracks ``grad_i`` and, unlike classic error feedback, the method has
guarantees for smooth non-convex objectives. The first exchange of each bucket is sent
uncompressed to initialise the estimates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torsh_distributed.compression.base import Comm, Compressor, Identity, Payload, Timer

__all__ = ["EF21"]


class EF21(Compressor):
    """EF21 around a contractive compressor (TopK recommended).

    Args:
        inner: The compressor of the differences; must not carry its own error feedback.
    """

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.name = f"ef21:{inner.name}"
        self.summable = inner.summable
        self.local: dict[int, torch.Tensor] = {}
        self.mean: dict[int, torch.Tensor] = {}

    def compress(self, tensor: torch.Tensor, *, key: int = 0) -> tuple[Payload, Any]:
        """Compress ``tensor - g_i`` and advance ``g_i`` by what is sent."""
        g = self.local.get(key)
        if g is None or g.shape != tensor.shape:
            g = torch.zeros_like(tensor)
        payload, ctx = self.inner.compress(tensor - g, key=key)
        self.local[key] = g + self.inner.decompress(payload, ctx)
        return payload, ctx

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def reduce(
        self,
        tensor: torch.Tensor,
        comm: Comm,
        *,
        key: int = 0,
        timer: Timer | None = None,
        shapes: Sequence[torch.Size] | None = None,
    ) -> torch.Tensor:
        timer = timer or Timer()
        g = self.mean.get(key)
        if g is None or g.shape != tensor.shape or key not in self.local:
            self.local[key] = tensor.clone()
            out = Identity().exchange([tensor.clone()], None, comm, timer)
            self.mean[key] = out.clone()
            return out
        with timer.compress:
            payload, ctx = self.compress(tensor, key=key)
        delta = self.inner.exchange(payload, ctx, comm, timer)
        with timer.decompress:
            g += delta
        return g.clone()

    def reset_errors(self) -> None:
        self.local.clear()  # the next exchange re-initialises both estimates densely
        self.mean.clear()
        self.inner.reset_errors()

    def state_dict(self) -> dict[str, Any]:
        return {
            "local": {str(k): v.clone() for k, v in self.local.items()},
            "mean": {str(k): v.clone() for k, v in self.mean.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local = {int(k): v.clone() for k, v in state.get("local", {}).items()}
        self.mean = {int(k): v.clone() for k, v in state.get("mean", {}).items()}
        self.inner.load_state_dict(state.get("inner", {}))
