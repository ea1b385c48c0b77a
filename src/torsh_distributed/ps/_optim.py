"""The servers' optimizer: torch.optim's SGD (momentum), Adagrad, Adam and AdamW update rules
applied to one key (a dense tensor) or to some rows of an embedding table, with per-key / per-row
state. The learning rate of each update is given by the caller (the step's, from a schedule).

The arithmetic mirrors torch's single-tensor (``foreach=False``) implementations op for op, so a
dense key matches ``torch.optim`` to rounding (the tests hold it to 1e-12 in fp64).
"""

from __future__ import annotations

import torch

from torsh_distributed.ps.config import ServerOptimConfig

__all__ = ["ServerOptimizer"]


class ServerOptimizer:
    """Per-key optimizer state and the update of one key or of some rows of a table.

    Args:
        config: The update rule and its hyper-parameters.
    """

    def __init__(self, config: ServerOptimConfig) -> None:
        self.config = config
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def _slots(self, key: str, like: torch.Tensor, *, rows: bool) -> dict[str, torch.Tensor]:
        state = self.state.get(key)
        if state is None:
            kind = self.config.kind
            state = {}
            if kind == "sgd" and self.config.momentum:
                state["momentum_buffer"] = torch.zeros_like(like)
                state["has_buffer"] = torch.zeros(like.shape[0] if rows else 1, dtype=torch.bool)
            elif kind == "adagrad":
                state["sum"] = torch.zeros_like(like)
            elif kind in ("adam", "adamw"):
                state["exp_avg"] = torch.zeros_like(like)
                state["exp_avg_sq"] = torch.zeros_like(like)
            state["step"] = torch.zeros(like.shape[0] if rows else 1, dtype=torch.int64)
            self.state[key] = state
        return state

    def _decay(self, param: torch.Tensor) -> float:
        cfg = self.config
        return 0.0 if cfg.decay_matrices_only and param.dim() < 2 else cfg.weight_decay

    def update_dense(
        self, key: str, param: torch.Tensor, grad: torch.Tensor, *, lr: float | None = None
    ) -> None:
        """Apply one step to ``param`` (in place) with gradient ``grad``, at learning rate
        ``lr`` (default: the config's)."""
        state = self._slots(key, param, rows=False)
        state["step"] += 1
        step = int(state["step"].item())
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        decay = self._decay(param)
        if decay and cfg.kind == "adamw":
            param.mul_(1 - lr * decay)
        elif decay:
            grad = grad.add(param, alpha=decay)
        if cfg.kind == "sgd":
            if cfg.momentum:
                buf = state["momentum_buffer"]
                if not bool(state["has_buffer"].item()):
                    buf.copy_(grad)
                    state["has_buffer"].fill_(True)
                else:
                    buf.mul_(cfg.momentum).add_(grad)
                grad = buf
            param.add_(grad, alpha=-lr)
        elif cfg.kind == "adagrad":
            acc = state["sum"]
            acc.addcmul_(grad, grad, value=1)
            std = acc.sqrt().add_(cfg.eps)
            param.addcdiv_(grad, std, value=-lr)
        else:
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(grad, 1 - cfg.beta1)
            exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
            bias_correction1 = 1 - cfg.beta1**step
            bias_correction2 = 1 - cfg.beta2**step
            step_size = lr / bias_correction1
            denom = (exp_avg_sq.sqrt() / (bias_correction2**0.5)).add_(cfg.eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)

    def update_rows(
        self,
        key: str,
        table: torch.Tensor,
        rows: torch.Tensor,
        grad: torch.Tensor,
        *,
        lr: float | None = None,
    ) -> None:
        """Apply one lazy step to ``table[rows]`` (unique local row indices) with ``grad``
        (``[len(rows), dim]``) at learning rate ``lr``; other rows and their state do not
        move."""
        state = self._slots(key, table, rows=True)
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        state["step"][rows] += 1
        param = table[rows]
        decay = self._decay(table)
        if decay and cfg.kind == "adamw":
            param.mul_(1 - lr * decay)
        elif decay:
            grad = grad.add(param, alpha=decay)
        if cfg.kind == "sgd":
            if cfg.momentum:
                has = state["has_buffer"][rows]
                buf = state["momentum_buffer"][rows]
                buf = torch.where(has.unsqueeze(1), buf * cfg.momentum + grad, grad)
                state["momentum_buffer"][rows] = buf
                state["has_buffer"][rows] = True
                grad = buf
            param.add_(grad, alpha=-lr)
        elif cfg.kind == "adagrad":
            acc = state["sum"][rows].addcmul_(grad, grad, value=1)
            state["sum"][rows] = acc
            param.addcdiv_(grad, acc.sqrt().add_(cfg.eps), value=-lr)
        else:
            step = state["step"][rows].to(table.dtype).unsqueeze(1)
            exp_avg = state["exp_avg"][rows].lerp_(grad, 1 - cfg.beta1)
            exp_avg_sq = state["exp_avg_sq"][rows].mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
            state["exp_avg"][rows] = exp_avg
            state["exp_avg_sq"][rows] = exp_avg_sq
            step_size = lr / (1 - cfg.beta1**step)
            denom = (exp_avg_sq.sqrt() / (1 - cfg.beta2**step).sqrt()).add_(cfg.eps)
            param.sub_(step_size * exp_avg / denom)
        table[rows] = param

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{"key/slot": tensor}`` (tensors only: safe for ``torch.load(weights_only=True)``)."""
        return {f"{key}/{slot}": t for key, slots in self.state.items() for slot, t in slots.items()}

    def load_state_dict(self, flat: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.state = {}
        for name, tensor in flat.items():
            key, _, slot = name.rpartition("/")
            self.state.setdefault(key, {})[slot] = tensor
