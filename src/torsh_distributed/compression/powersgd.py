"""PowerSGD (Vogels et al. 2019): rank-``r`` approximation by one warm-started power iteration.

Per bucket, every parameter matrix ``M`` (``n x m``, parameters of more dims are viewed as
``shape[0] x rest``) is sent as two thin factors: ``P = M Q`` is all-reduced and
orthogonalised (torch's ``_orthogonalize`` from its PowerSGD hook), then ``Q = M^T P`` is
all-reduced, and the bucket becomes ``P Q^T``: ``(n + m) r`` numbers instead of ``n m``.
Vectors (biases, norms) and matrices that would not shrink by ``min_compression_rate`` are
all-reduced uncompressed in the first round. ``Q`` is kept as the next step's start (warm
start); with error feedback (on by default, as in the paper and in torch's hook) the residual
``M - P Q^T`` of the compressed matrices is added to the next gradient.

Why not torch's hook itself: it is a whole DDP hook that does its own communication, and its
state has no ``state_dict``; here the same algorithm sits behind the common interface (so it is
accounted, checkpointed and usable by the adaptive mode) and reuses torch's orthogonalisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torsh_distributed.compression.base import Comm, Compressor, Payload, Timer

try:  # torch's implementation of the orthogonalisation (Gram-Schmidt for r <= 2, else QR)
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
except ImportError:  # pragma: no cover - torch built without distributed
    _orthogonalize = None

__all__ = ["PowerSGD"]

_EPS = 1e-8


def _orth(p: torch.Tensor) -> torch.Tensor:
    if _orthogonalize is not None:
        batch = p.unsqueeze(0).contiguous()
        _orthogonalize(batch, epsilon=_EPS)
        return batch[0]
    return torch.linalg.qr(p).Q  # pragma: no cover


def _layout(n: int, shapes: Sequence[torch.Size] | None) -> list[tuple[int, int, int]]:
    """``(offset, rows, cols)`` of each block of the flat bucket; ``cols == 0`` marks a vector."""
    if not shapes:
        rows = max(1, math.isqrt(n))
        cols = -(-n // rows)
        if rows * cols != n:  # not a rectangle: largest rectangle + a vector tail
            cols = n // rows
            return [(0, rows, cols), (rows * cols, n - rows * cols, 0)]
        return [(0, rows, cols)]
    blocks, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) >= 2:
            blocks.append((offset, shape[0], numel // shape[0]))
        else:
            blocks.append((offset, numel, 0))
        offset += numel
    if offset != n:
        raise ValueError(f"PowerSGD: shapes cover {offset} elements, the bucket has {n}")
    return blocks


class PowerSGD(Compressor):
    """Low-rank compression; see the module docstring.

    Args:
        rank: Rank ``r`` of the approximation; higher = more accurate, more bytes.
        error_feedback: Accumulate ``M - P Q^T`` and add it to the next gradient.
        warm_start: Reuse last step's ``Q`` (one power iteration per step converges over steps);
            off = a fresh random ``Q`` every step.
        min_compression_rate: Compress a matrix only if ``n m > rate (n + m) r``.
        seed: Seed of the initial ``Q`` (must be equal on every rank).
    """

    summable = True

    def __init__(
        self,
        rank: int,
        *,
        error_feedback: bool = True,
        warm_start: bool = True,
        min_compression_rate: float = 2.0,
        seed: int = 0,
    ) -> None:
        if rank < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {rank}")
        self.rank = rank
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self.name = f"powersgd:{rank}"
        self.qs: dict[int, list[torch.Tensor]] = {}
        self.residuals: dict[int, torch.Tensor] = {}

    def _plan(self, n: int, shapes: Sequence[torch.Size] | None) -> tuple[list, list]:
        low, dense = [], []
        for offset, rows, cols in _layout(n, shapes):
            r = min(self.rank, rows, cols)
            if cols and rows * cols > self.min_compression_rate * (rows + cols) * r:
                low.append((offset, rows, cols, r))
            else:
                dense.append((offset, rows * cols if cols else rows))
        return low, dense

    def _q(self, key: int, low: list, device: torch.device) -> list[torch.Tensor]:
        qs = self.qs.get(key)
        if (
            not self.warm_start
            or qs is None
            or [q.shape for q in qs] != [(c, r) for _, _, c, r in low]
        ):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
            qs = [torch.randn(c, r, generator=g).to(device) for _, _, c, r in low]
        return qs

    def compress(
        self, tensor: torch.Tensor, *, key: int = 0, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Any]:
        """One rank's factors (the world-of-one case of :meth:`reduce`): ``[dense, P, Q]``."""
        flat = tensor.reshape(-1)
        low, dense = self._plan(flat.numel(), shapes)
        qs = self._q(key, low, flat.device)
        ps = [
            _orth(flat[o : o + n * m].view(n, m) @ q)
            for (o, n, m, _), q in zip(low, qs, strict=True)
        ]
        qs = [
            flat[o : o + n * m].view(n, m).t() @ p for (o, n, m, _), p in zip(low, ps, strict=True)
        ]
        self.qs[key] = [q.clone() for q in qs]
        payload = [_cat([flat[o : o + k] for o, k in dense], flat), _cat(ps, flat), _cat(qs, flat)]
        return payload, (flat.numel(), low, dense)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        n, low, dense = ctx
        dense_flat, p_flat, q_flat = payload
        out = torch.zeros(n, dtype=dense_flat.dtype if dense_flat.numel() else p_flat.dtype,
                          device=dense_flat.device)
        i = 0
        for o, k in dense:
            out[o : o + k] = dense_flat[i : i + k]
            i += k
        ip = iq = 0
        for o, rows, cols, r in low:
            p = p_flat[ip : ip + rows * r].view(rows, r)
            q = q_flat[iq : iq + cols * r].view(cols, r)
            out[o : o + rows * cols] = (p @ q.t()).reshape(-1)
            ip += rows * r
            iq += cols * r
        return out

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
        w = comm.world_size
        with timer.compress:
            flat = tensor.reshape(-1)
            residual = self.residuals.get(key)
            if self.error_feedback and residual is not None and residual.shape == flat.shape:
                flat = flat + residual
            low, dense = self._plan(flat.numel(), shapes)
            qs = self._q(key, low, flat.device)
            mats = [flat[o : o + n * m].view(n, m) for o, n, m, _ in low]
            ps = [mat @ q for mat, q in zip(mats, qs, strict=True)]
            first = _cat([flat[o : o + k] for o, k in dense] + [p.reshape(-1) for p in ps], flat)
        comm.all_reduce_sum([first])
        with timer.compress:
            num_dense = sum(k for _, k in dense)
            ps = _split(first[num_dense:], [(n, r) for _, n, _, r in low])
            ps = [_orth(p) for p in ps]
            second = _cat([(mat.t() @ p).reshape(-1) for mat, p in zip(mats, ps, strict=True)], flat)
        comm.all_reduce_sum([second])
        with timer.decompress:
            second.div_(w)
            qs = _split(second, [(m, r) for _, _, m, r in low])
            self.qs[key] = qs
            ctx = (flat.numel(), low, dense)
            out = self.decompress([first[:num_dense].div_(w), _cat(ps, flat), second], ctx)
            if self.error_feedback:
                residual = flat - out
                for o, k in dense:  # sent exactly: no error to carry
                    residual[o : o + k] = 0
                self.residuals[key] = residual
        return out

    def take_residual(self, key: int) -> torch.Tensor | None:
        return self.residuals.pop(key, None)

    def reset_errors(self) -> None:
        self.residuals.clear()
        self.qs.clear()  # a NaN warm start would stay NaN

    def state_dict(self) -> dict[str, Any]:
        return {
            "qs": {str(k): [q.clone() for q in v] for k, v in self.qs.items()},
            "residuals": {str(k): v.clone() for k, v in self.residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.qs = {int(k): [q.clone() for q in v] for k, v in state.get("qs", {}).items()}
        self.residuals = {int(k): v.clone() for k, v in state.get("residuals", {}).items()}


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The parts flattened and joined; empty: a 0-entry tensor on ``like``'s device."""
    parts = [p.reshape(-1) for p in parts]
    return torch.cat(parts) if parts else like.new_zeros(0, dtype=torch.float32)


def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, i = [], 0
    for rows, cols in shapes:
        out.append(flat[i : i + rows * cols].view(rows, cols))
        i += rows * cols
    return out
