"""Reduction operators of the facade, with MEAN emulated where a backend lacks AVG."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

__all__ = ["ReduceOp", "combine_", "finish_mean_", "check_dtype"]


class ReduceOp(enum.Enum):
    """What a reducing collective computes element-wise across ranks.

    ``MEAN`` is native on NCCL (``AVG``); elsewhere it is a ``SUM`` followed by a division on
    every rank, so it needs a floating-point (or complex) tensor. ``BAND``/``BOR``/``BXOR`` need an
    integral or bool tensor.
    """

    SUM = "sum"
    MEAN = "mean"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @classmethod
    def parse(cls, value: ReduceOp | str | dist.ReduceOp) -> ReduceOp:
        """Accept a :class:`ReduceOp`, its name (``"sum"``, ``"avg"``) or torch's ``ReduceOp``."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str):
            name = value.lower()
            name = {"avg": "mean", "prod": "product"}.get(name, name)
            try:
                return cls(name)
            except ValueError:
                allowed = ", ".join(m.value for m in cls)
                raise ValueError(f"unknown reduce op {value!r}; choose one of {allowed}") from None
        for member, native in _TORCH.items():
            if value == native:
                return member
        if value == dist.ReduceOp.AVG:
            return cls.MEAN
        raise TypeError(f"op must be a ReduceOp or its name, got {value!r}")

    def to_torch(self, *, native_avg: bool) -> dist.ReduceOp:
        """torch's operator; MEAN maps to AVG only when ``native_avg`` (else SUM, divide later)."""
        if self is ReduceOp.MEAN:
            return dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        return _TORCH[self]


_TORCH = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def check_dtype(op: ReduceOp, dtype: torch.dtype) -> None:
    """Raise ``TypeError`` for combinations no backend can compute."""
    if op is ReduceOp.MEAN and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"ReduceOp.MEAN needs a floating-point tensor, got {dtype}; use SUM")
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"ReduceOp.{op.name} needs an integral or bool tensor, got {dtype}")


def combine_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """``acc = acc (op) other`` in place (MEAN accumulates a sum; see :func:`finish_mean_`)."""
    if op in (ReduceOp.SUM, ReduceOp.MEAN):
        if acc.dtype == torch.bool:
            return acc.logical_or_(other)
        return acc.add_(other)
    if op is ReduceOp.PRODUCT:
        if acc.dtype == torch.bool:
            return acc.logical_and_(other)
        return acc.mul_(other)
    if op is ReduceOp.MIN:
        return torch.minimum(acc, other, out=acc)
    if op is ReduceOp.MAX:
        return torch.maximum(acc, other, out=acc)
    if op is ReduceOp.BAND:
        return acc.bitwise_and_(other)
    if op is ReduceOp.BOR:
        return acc.bitwise_or_(other)
    return acc.bitwise_xor_(other)


def finish_mean_(tensor: torch.Tensor, op: ReduceOp, count: int) -> torch.Tensor:
    """Turn an accumulated sum into the mean over ``count`` ranks (no-op for other ops)."""
    if op is ReduceOp.MEAN and count > 1:
        tensor.div_(count)
    return tensor
