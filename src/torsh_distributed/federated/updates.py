"""Compressed client-to-server updates: the toolkit's compressors on ``w_client - w_global``.

A client encodes its update (the difference of its weights and the round's global weights) per
tensor with a compressor of :mod:`torsh_distributed.compression` (``fp16``, ``bf16``, ``int8``,
``topk:R``, ``sign``, ``powersgd:RANK``), with error feedback kept per client
across rounds (Flower's per-node ``Context.state``): what a round did not send is added to the
next round's update (Seide et al. 2014; Karimireddy et al. 2019), so biased compressors (TopK,
sign, PowerSGD) still converge. The payload tensors travel in the reply's ``ArrayRecord``; the
small context each needs to decode (sizes, dtypes, PowerSGD's layout) as JSON in a
``ConfigRecord``. The server decodes each reply back to full weights before the strategy
aggregates, so every Flower strategy (and the DP wrapper) works on compressed updates unchanged.
The reply's bytes are what the server counts per round.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from torsh_distributed.compression.base import Compressor

__all__ = ["FEDERATED_METHODS", "LADDER", "LinkAdaptation", "UpdateCodec", "check_method", "spec_of"]

FEDERATED_METHODS = ("none", "fp16", "bf16", "int8", "topk", "sign", "powersgd")
"""Compression methods that encode one client's update on their own (no collective)."""

_CTX_KEY = "torsh-update"
_SEP = "#"


LADDER = ("none", "fp16", "int8", "topk:0.1", "topk:0.01")
"""``adaptive``'s methods, least to most compressed (bytes per fp32 value: 4, 2, 1, 0.8, 0.08)."""


class LinkAdaptation:
    """``compression adaptive``: each client's method follows its measured link.

    After each round the server knows, per client, the turnaround of its message (sent to reply
    received) minus the client's own training time: the time its round spent on the link (the
    model down, the update up) and in start-up. A client whose link time exceeds ``budget`` seconds
    moves one step up :data:`LADDER` (more compression) for its next round; one under a quarter of
    the budget moves one step down (less loss). Clients start uncompressed. A feedback rule, not a
    bandwidth model: it needs no probe traffic and settles each client on the lightest method that
    keeps its link time within the budget.

    Args:
        budget: Link seconds per client per round that trigger more compression.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.level: dict[int, int] = {}

    def method(self, node: int) -> str:
        return LADDER[self.level.get(node, 0)]

    def observe(self, node: int, link_s: float) -> None:
        level = self.level.get(node, 0)
        if link_s > self.budget:
            level = min(level + 1, len(LADDER) - 1)
        elif link_s < self.budget / 4:
            level = max(level - 1, 0)
        self.level[node] = level

    def state_dict(self) -> dict[str, Any]:
        return {"level": {str(k): v for k, v in self.level.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level = {int(k): int(v) for k, v in state.get("level", {}).items()}


def check_method(spec: str) -> None:
    """``ValueError`` unless ``spec`` is a compression spec usable on federated updates."""
    from torsh_distributed.compression.spec import parse_spec

    if spec == "adaptive":
        return
    try:
        kind = parse_spec(spec).kind
    except ValueError as exc:
        raise ValueError(f"federated compression: {exc}") from None
    if kind not in FEDERATED_METHODS:
        raise ValueError(
            f"compression {spec!r} cannot encode a single client's update; use one of "
            f"{', '.join(m for m in FEDERATED_METHODS if m != 'none')} (with their parameters, "
            "e.g. topk:0.01, powersgd:4)"
        )


def _encode_ctx(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        return [_encode_ctx(v) for v in value]
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    raise TypeError(f"cannot send a compression context of type {type(value).__name__}")


def _decode_ctx(value: Any) -> Any:
    if isinstance(value, dict):
        return getattr(torch, value["dtype"])
    if isinstance(value, list):
        return [_decode_ctx(v) for v in value]
    return value


class UpdateCodec:
    """Encodes a client's update and decodes it on the server.

    Args:
        spec: The compression spec (``int8``, ``topk:0.01``, ``powersgd:4``, ...).
        error_feedback: Keep what was not sent and add it to the next update (the default for
            the biased methods is on; for ``int8``/``fp16`` it removes their rounding bias).
        seed: Seed of random choices (RandomK's indices, PowerSGD's initial factors).
    """

    def __init__(self, spec: str, *, error_feedback: bool = True, seed: int = 0) -> None:
        from torsh_distributed.compression.spec import build_fixed

        check_method(spec)
        self.spec = spec
        self.error_feedback = error_feedback
        self.compressor: Compressor = build_fixed(spec, error_feedback=False, seed=seed)

    def _compress(self, flat: torch.Tensor, shape: torch.Size, key: int) -> tuple[list[torch.Tensor], Any]:
        if self.spec.startswith("powersgd"):
            return self.compressor.compress(flat, key=key, shapes=[shape])  # type: ignore[call-arg]
        return self.compressor.compress(flat, key=key)

    def encode(
        self,
        global_state: dict[str, torch.Tensor],
        new_state: dict[str, torch.Tensor],
        residuals: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], str, dict[str, torch.Tensor]]:
        """The payload tensors, the JSON context, and the new residuals.

        Non-floating tensors (e.g. BatchNorm's counters) are sent as they are.
        """
        payload: dict[str, torch.Tensor] = {}
        contexts: dict[str, Any] = {}
        new_residuals: dict[str, torch.Tensor] = {}
        for key, (name, new) in enumerate(new_state.items()):
            if not new.is_floating_point():
                payload[f"{name}{_SEP}raw"] = new
                contexts[name] = {"raw": True}
                continue
            delta = (new.float() - global_state[name].float()).reshape(-1)
            residual = residuals.get(name)
            if self.error_feedback and residual is not None and residual.shape == delta.shape:
                delta = delta + residual
            parts, ctx = self._compress(delta, new.shape, key)
            if self.error_feedback:
                new_residuals[name] = delta - self.compressor.decompress(parts, ctx).reshape(-1)
            for j, part in enumerate(parts):
                payload[f"{name}{_SEP}{j}"] = part.contiguous()
            contexts[name] = {"parts": len(parts), "ctx": _encode_ctx(ctx), "shape": list(new.shape),
                              "dtype": str(new.dtype).removeprefix("torch.")}  # fmt: skip
        return payload, json.dumps({"spec": self.spec, "tensors": contexts}), new_residuals

    def decode(self, global_state: dict[str, torch.Tensor], payload: dict[str, torch.Tensor], ctx_json: str) -> dict[str, torch.Tensor]:
        """The client's full weights from its payload (global weights + decoded update).

        Raises:
            ValueError: the reply was encoded with another method or for other tensors.
        """
        meta = json.loads(ctx_json)
        if meta.get("spec") != self.spec:
            raise ValueError(f"update encoded with {meta.get('spec')!r}, this codec decodes {self.spec!r}")
        tensors = meta["tensors"]
        if set(tensors) != set(global_state):
            raise ValueError("the compressed update's tensors differ from the global model's")
        out: dict[str, torch.Tensor] = {}
        for name, info in tensors.items():
            if info.get("raw"):
                out[name] = payload[f"{name}{_SEP}raw"]
                continue
            parts = [payload[f"{name}{_SEP}{j}"] for j in range(info["parts"])]
            delta = self.compressor.decompress(parts, _decode_ctx(info["ctx"]))
            base = global_state[name]
            out[name] = (base.float() + delta.float().reshape(base.shape)).to(getattr(torch, info["dtype"]))
        return out


def spec_of(ctx_json: str) -> str:
    """The method a reply's update was encoded with."""
    return str(json.loads(ctx_json)["spec"])


def ctx_key() -> str:
    """Name of the reply's ``ConfigRecord`` that carries the JSON context."""
    return _CTX_KEY
