"""1-bit Adam and 0/1 Adam: Adam optimizers that own their data-parallel communication.

Error feedback under Adam delays coordinates, and Adam's per-coordinate normalisation amplifies
the delay (docs/compression.md). These two methods compress a quantity Adam makes uniform
instead: the *momentum*, once the variance is frozen.

:class:`OneBitAdam` (Tang et al. 2021, DeepSpeed's ``OneBitAdam``): ``freeze_step`` steps of
plain AdamW on the mean gradient (the warm-up: an fp32 all-reduce), then the variance is frozen
and every step updates the momentum with the *local* gradient, all-reduces the momentum with
1-bit codes and error feedback on the worker and the server side
(:class:`~._onebit.OneBitAllReduce`: a compressed reduce-scatter then all-gather), and steps with
the frozen variance. 21x fewer bytes per step after the warm-up (blocks of 64 entries per scale).

:class:`ZeroOneAdam` (Lu et al. 2022, DeepSpeed's ``ZeroOneAdam``): no fp32 warm-up. Until
``var_freeze_step`` the variance is updated only at the steps of an exponentially thinning set
(every step for ``var_update_scaler`` updates, then every 2nd for as many, every 4th, ...); those
steps all-reduce the gradient in fp32, the others exchange it with 1-bit codes. After the
freeze, steps are local (no communication) between synchronisations that exchange the
lr-weighted sum of the local momenta with 1-bit codes; the interval between synchronisations
starts at 1 and doubles every ``local_step_scaler`` steps up to ``local_step_clipper``.
Parameters are identical on every rank after each synchronisation (every rank decodes the same
codes onto the same anchor).

Both use AdamW's decoupled weight decay and bias corrections (the warm-up of :class:`OneBitAdam`
is torch's AdamW, bit for bit; the frozen variance keeps its correction from the freeze);
DeepSpeed's versions have no bias correction.

In a user's own loop (docs/compression.md, "1-bit Adam"): build the optimizer over the
data-parallel group and do not let DDP all-reduce the gradients (it would add an fp32 exchange
to the optimizer's): either train the bare model (the optimizer broadcasts rank 0's parameters
when it is built, as DDP does), or wrap it in DDP and call :func:`replace_ddp_allreduce`, which
registers a communication hook that all-reduces only the steps that need the mean gradient.
Call :meth:`~OneBitOptimizer.synchronize` before clipping gradients so that the warm-up clips
the mean gradient as AdamW under DDP does (``step`` synchronises if nobody did).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adam import adam

from torsh_distributed.compression._onebit import FlatLayout, OneBitAllReduce
from torsh_distributed.compression.base import Comm
from torsh_distributed.compression.hooks import StepStats

__all__ = ["OneBitAdam", "OneBitOptimizer", "ZeroOneAdam", "check_layout", "replace_ddp_allreduce"]


class OneBitOptimizer(torch.optim.Optimizer):
    """What both optimizers share: the flat layout, the 1-bit all-reduce, the fp32 gradient
    all-reduce of the steps that need the mean gradient, byte accounting and per-rank state."""

    method = "?"

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        group: dist.ProcessGroup | None,
        block: int,
        broadcast: bool,
    ) -> None:
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if eps <= 0 or weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, got {eps}, {weight_decay}")
        if block < 8 or block % 8:
            raise ValueError(f"block must be a positive multiple of 8, got {block}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.comm = Comm(group=group)
        self.params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._group_of = [
            i for i, g in enumerate(self.param_groups) for p in g["params"] if p.requires_grad
        ]
        world = self.comm.world_size
        device = self.params[0].device if self.params else torch.device("cpu")
        self.layout = FlatLayout(
            [p.numel() for p in self.params], block=block, world_size=world, device=device
        )
        self.onebit = OneBitAllReduce(self.layout, self.comm)
        for p in self.params:  # eager: checkpoint loaders never need a dummy step
            self.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        numel = sum(p.numel() for p in self.params)
        self._dense_bytes = int(2 * (world - 1) / world * 4 * numel) if world > 1 else 0
        self.totals = {"warmup": StepStats(), "compressed": StepStats()}
        self._mark = 0  # comm.bytes_sent at the end of the last step
        self._mean_ready = False
        if broadcast and world > 1:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            with torch.no_grad():
                for p in self.params:
                    dist.broadcast(p.data, src=src, group=group)

    # --- the schedule (subclasses) ---------------------------------------------------------

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken so far (the ``step`` of the optimizer state)."""
        return int(self.state[self.params[0]]["step"]) if self.params else 0

    def needs_mean_grads(self) -> bool:
        """Whether the next step uses the fp32 mean gradient (the DDP hook all-reduces then)."""
        raise NotImplementedError

    def frozen(self, step: int) -> bool:
        """Whether 1-based ``step`` is past the warm-up (counted as compressed)."""
        raise NotImplementedError

    def _step(self, t: int, grads: list[torch.Tensor]) -> None:
        raise NotImplementedError

    # --- communication ---------------------------------------------------------------------

    def synchronize(self) -> None:
        """Average the gradients over the group now if the next step needs the mean gradient
        (call it before clipping); otherwise leave them local. Idempotent within a step."""
        if self._mean_ready or not self.needs_mean_grads():
            return
        self._mean_ready = True
        w = self.comm.world_size
        if w == 1:
            return
        grads = self._grads()
        flat = torch.cat([g.reshape(-1).float() for g in grads]).div_(w)
        self.comm.all_reduce_sum([flat])
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # new gradients are local until synchronised (a step the loss scaler skipped left the flag)
        self._mean_ready = False
        super().zero_grad(set_to_none=set_to_none)

    def _grads(self) -> list[torch.Tensor]:
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        t = self.steps_taken + 1
        self._step(t, self._grads())
        for p in self.params:
            self.state[p]["step"] += 1
        self._mean_ready = False
        stats = self.totals["compressed" if self.frozen(t) else "warmup"]
        stats.add(
            StepStats(
                bytes_uncompressed=self._dense_bytes,
                bytes_sent=self.comm.bytes_sent - self._mark,
                buckets=1,
            )
        )
        self._mark = self.comm.bytes_sent
        return loss

    def _adam_update(
        self, p: torch.Tensor, t: int, *, bc2: float, group: dict[str, Any]
    ) -> torch.Tensor:
        """AdamW's update of ``p`` with its momentum and (frozen or live) variance; returns the
        denominator."""
        st = self.state[p]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        bc1 = 1 - group["betas"][0] ** t
        denom = st["exp_avg_sq"].sqrt().div_(math.sqrt(bc2)).add_(eps)
        p.mul_(1 - lr * wd)
        p.addcdiv_(st["exp_avg"], denom, value=-lr / bc1)
        return denom

    # --- accounting and state --------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Bytes of this rank: in total, and after the warm-up (``after_freeze``)."""
        total = StepStats()
        for s in self.totals.values():
            total.add(s)
        after = self.totals["compressed"]
        return {
            "method": self.method,
            "steps": total.buckets,
            "bytes_uncompressed": total.bytes_uncompressed,
            "bytes_sent": total.bytes_sent,
            "ratio": total.ratio,
            "seconds": self.comm.comm_s,
            "after_freeze": {
                "steps": after.buckets,
                "bytes_uncompressed": after.bytes_uncompressed,
                "bytes_sent": after.bytes_sent,
                "ratio": after.ratio,
            },
        }

    @property
    def local_state(self) -> _LocalState:
        """The ``Stateful`` of what differs per rank (error buffers, 0/1 Adam's local steps) and
        the byte totals: a checkpoint saves it per rank (the engine's ``rank_state``)."""
        return _LocalState(self)

    def _local_state_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "onebit": self.onebit.state_dict(),
            "totals": {k: v.as_dict() for k, v in self.totals.items()},
        }

    def _load_local_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            raise ValueError(f"saved by {state.get('method')!r}, this run uses {self.method!r}")
        self.onebit.load_state_dict(state["onebit"])
        for name, saved in state["totals"].items():
            self.totals[name] = StepStats(**{k: v for k, v in saved.items() if k != "ratio"})
        self._mark = self.comm.bytes_sent


class _LocalState:
    def __init__(self, optimizer: OneBitOptimizer) -> None:
        self._optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer._local_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._optimizer._load_local_state_dict(state)


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam (see the module docstring).

    Args:
        params: Parameters or parameter groups (per-group ``lr``/``weight_decay`` as AdamW).
        lr: Learning rate.
        betas: Momentum and variance decay (the variance stops at ``freeze_step``).
        eps: Denominator epsilon.
        weight_decay: Decoupled weight decay (AdamW's).
        freeze_step: Warm-up steps of fp32 AdamW before the variance is frozen and the momentum
            is exchanged with 1-bit codes (>= 1). Too short and the frozen variance is a poor
            estimate (the paper warms up for 15-25 % of the run); too long and fewer steps
            are compressed.
        group: Data-parallel process group (``None``: the default group).
        block: Entries per fp32 scale of the 1-bit codes (a multiple of 8): smaller blocks
            follow the magnitudes more closely and cost ``32 / block`` bits per entry.
        broadcast: Broadcast rank 0's parameters at construction (as DDP does).
    """

    method = "onebit_adam"

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100,
        group: dist.ProcessGroup | None = None,
        block: int = 64,
        broadcast: bool = True,
    ) -> None:
        if freeze_step < 1:
            raise ValueError(
                f"freeze_step must be >= 1 (a variance must be learned before it is frozen), "
                f"got {freeze_step}"
            )
        self.freeze_step = freeze_step
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            group=group,
            block=block,
            broadcast=broadcast,
        )

    def needs_mean_grads(self) -> bool:
        return self.steps_taken + 1 <= self.freeze_step

    def frozen(self, step: int) -> bool:
        return step > self.freeze_step

    def _step(self, t: int, grads: list[torch.Tensor]) -> None:
        if not self.frozen(t):  # the warm-up: torch's AdamW on the mean gradient
            for gi, group in enumerate(self.param_groups):
                idx = [i for i, g in enumerate(self._group_of) if g == gi]
                if not idx:
                    continue
                ps = [self.params[i] for i in idx]
                adam(
                    ps,
                    [grads[i] for i in idx],
                    [self.state[p]["exp_avg"] for p in ps],
                    [self.state[p]["exp_avg_sq"] for p in ps],
                    [],
                    [self.state[p]["step"].clone() for p in ps],  # step counted by step()
                    foreach=True,
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
            return
        momenta = []
        for p, g, gi in zip(self.params, grads, self._group_of, strict=True):
            beta1 = self.param_groups[gi]["betas"][0]
            m = self.state[p]["exp_avg"]
            m.mul_(beta1).add_(g, alpha=1 - beta1)  # the local gradient
            momenta.append(m)
        mean = self.onebit.reduce(self.layout.flatten(momenta))
        self.layout.unflatten_into(mean, momenta)  # the same momentum on every rank
        for p, gi in zip(self.params, self._group_of, strict=True):
            group = self.param_groups[gi]
            self._adam_update(p, t, bc2=1 - group["betas"][1] ** self.freeze_step, group=group)


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam (see the module docstring).

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        betas: Momentum and variance decay.
        eps: Denominator epsilon.
        weight_decay: Decoupled weight decay (AdamW's).
        var_freeze_step: The last step that may update the variance (the paper's
            ``max T_v``; DeepSpeed suggests the end of the learning-rate warm-up), >= 1.
        var_update_scaler: Variance updates per interval before the interval doubles (the
            paper's kappa): larger keeps more fp32 steps early.
        local_step_scaler: Steps after the freeze before the interval between synchronisations
            doubles: larger keeps synchronising every step for longer.
        local_step_clipper: The longest interval between synchronisations (the paper's H).
        group: Data-parallel process group (``None``: the default group).
        block: Entries per fp32 scale of the 1-bit codes (a multiple of 8).
        broadcast: Broadcast rank 0's parameters at construction.
    """

    method = "zerooneadam"

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        group: dist.ProcessGroup | None = None,
        block: int = 64,
        broadcast: bool = True,
    ) -> None:
        for name, value in (
            ("var_freeze_step", var_freeze_step),
            ("var_update_scaler", var_update_scaler),
            ("local_step_scaler", local_step_scaler),
            ("local_step_clipper", local_step_clipper),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            group=group,
            block=block,
            broadcast=broadcast,
        )
        n = len(self.param_groups)
        self._lrs, self._decay = [0.0] * n, [1.0] * n  # since the last synchronisation
        self._acc: list[torch.Tensor] = []  # lr-weighted momentum sums (the paper's u)
        self._anchor: list[torch.Tensor] = []  # parameters at the last synchronisation
        self._schedule(0)

    def _schedule(self, done: int) -> None:
        """The variance schedule after ``done`` steps: the interval, the updates in it, and
        the updates so far (deterministic in the step: recomputed on load)."""
        self._var_interval, self._var_counter, self._var_updates = 1, 0, 0
        for t in range(1, min(done, self.var_freeze_step) + 1):
            self._advance_variance(t)

    def _advance_variance(self, t: int) -> bool:
        if t % self._var_interval:
            return False
        self._var_updates += 1
        self._var_counter += 1
        if self._var_counter == self.var_update_scaler:
            self._var_counter, self._var_interval = 0, self._var_interval * 2
        return True

    def _local_interval(self, t: int) -> int:
        done = t - self.var_freeze_step - 1  # steps after the freeze before this one
        return min(self.local_step_clipper, 2 ** (done // self.local_step_scaler))

    def needs_mean_grads(self) -> bool:
        t = self.steps_taken + 1
        return t <= self.var_freeze_step and t % self._var_interval == 0

    def frozen(self, step: int) -> bool:
        return step > self.var_freeze_step

    def _step(self, t: int, grads: list[torch.Tensor]) -> None:
        if not self.frozen(t):
            self._variance_phase(t, grads)
            if t == self.var_freeze_step:  # the errors were of gradients; now of momenta
                self.onebit.reset()
                self._anchor = [p.detach().clone() for p in self.params]
                self._acc = [torch.zeros_like(p) for p in self.params]
            return
        if not self._anchor:  # resumed without this rank's state: synchronised from here
            self._anchor = [p.detach().clone() for p in self.params]
            self._acc = [torch.zeros_like(p) for p in self.params]
        for p, g, gi, acc in zip(self.params, grads, self._group_of, self._acc, strict=True):
            group = self.param_groups[gi]
            beta1 = group["betas"][0]
            m = self.state[p]["exp_avg"]
            m.mul_(beta1).add_(g, alpha=1 - beta1)  # the local gradient
            bc = 1 - group["betas"][1] ** self._var_updates
            self._adam_update(p, t, bc2=bc, group=group)
            acc.add_(m, alpha=group["lr"] / (1 - beta1**t))
        for gi, group in enumerate(self.param_groups):
            self._lrs[gi] += group["lr"]
            self._decay[gi] *= 1 - group["lr"] * group["weight_decay"]
        if t % self._local_interval(t) == 0:
            self._synchronise(t)

    def _variance_phase(self, t: int, grads: list[torch.Tensor]) -> None:
        if self._advance_variance(t):  # the mean gradient (fp32 all-reduce): m and v
            used = grads
            for p, g, gi in zip(self.params, grads, self._group_of, strict=True):
                beta2 = self.param_groups[gi]["betas"][1]
                self.state[p]["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        else:  # the gradient in 1-bit codes: m only
            used = [torch.empty_like(g) for g in grads]
            mean = self.onebit.reduce(self.layout.flatten(grads))
            self.layout.unflatten_into(mean, used)
        for p, g, gi in zip(self.params, used, self._group_of, strict=True):
            group = self.param_groups[gi]
            beta1 = group["betas"][0]
            self.state[p]["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            self._adam_update(p, t, bc2=1 - group["betas"][1] ** self._var_updates, group=group)

    def _synchronise(self, t: int) -> None:
        """Exchange the lr-weighted momentum sums; restart every rank from the same point."""
        mean = self.onebit.reduce(self.layout.flatten(self._acc))
        self.layout.unflatten_into(mean, self._acc)
        for p, gi, acc, anchor in zip(
            self.params, self._group_of, self._acc, self._anchor, strict=True
        ):
            group = self.param_groups[gi]
            st = self.state[p]
            bc2 = 1 - group["betas"][1] ** self._var_updates
            denom = st["exp_avg_sq"].sqrt().div_(math.sqrt(bc2)).add_(group["eps"])
            anchor.mul_(self._decay[gi]).addcdiv_(acc, denom, value=-1.0)
            p.copy_(anchor)
            if self._lrs[gi] > 0:  # the mean momentum over the interval, bias correction undone
                st["exp_avg"].copy_(acc).mul_((1 - group["betas"][0] ** t) / self._lrs[gi])
            acc.zero_()
        n = len(self.param_groups)
        self._lrs, self._decay = [0.0] * n, [1.0] * n

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._schedule(self.steps_taken)

    def _local_state_dict(self) -> dict[str, Any]:
        out = super()._local_state_dict()
        if self._anchor:  # after the freeze: the local steps since the last synchronisation
            out["local"] = {
                "lrs": list(self._lrs),
                "decay": list(self._decay),
                "acc": [a.clone() for a in self._acc],
                "anchor": [a.clone() for a in self._anchor],
                "exp_avg": [self.state[p]["exp_avg"].clone() for p in self.params],
                "params": [p.detach().clone() for p in self.params],
            }
        return out

    def _load_local_state_dict(self, state: dict[str, Any]) -> None:
        super()._load_local_state_dict(state)
        local = state.get("local")
        if local is None:
            self._anchor, self._acc = [], []
            return
        self._lrs, self._decay = list(local["lrs"]), list(local["decay"])
        self._acc = [a.clone() for a in local["acc"]]
        self._anchor = [a.clone() for a in local["anchor"]]
        with torch.no_grad():
            for p, m, v in zip(self.params, local["exp_avg"], local["params"], strict=True):
                self.state[p]["exp_avg"].copy_(m)
                p.copy_(v)


def check_layout(optimizer: Any, *, zero_stage: int, model_parallel: bool, compressed: bool) -> None:
    """Refuse a 1-bit optimizer (say, from a user's optimizer factory) on a layout it cannot
    serve; the engine's own ``--optimizer`` is refused earlier, by its config.

    Raises:
        ValueError: ZeRO, tensor/pipeline/expert parallelism or a compression method with it.
    """
    if not isinstance(optimizer, OneBitOptimizer):
        return
    if zero_stage or model_parallel or compressed:
        raise ValueError(
            f"{type(optimizer).__name__} exchanges whole replicas' momenta itself: it needs "
            "--zero-stage 0 without tp/pp/ep and without --compression (or use AdamW with "
            "--compression)"
        )


def replace_ddp_allreduce(model: nn.parallel.DistributedDataParallel, optimizer: Any) -> None:
    """Make ``optimizer`` (a :class:`OneBitAdam` or :class:`ZeroOneAdam`) do DDP's gradient
    exchange: a communication hook that all-reduces the buckets (fp32, counted in the
    optimizer's bytes) only before the steps that need the mean gradient, and otherwise leaves
    each rank's gradient local. DDP then adds no communication of its own."""
    if not isinstance(optimizer, OneBitOptimizer):
        raise TypeError(f"expected OneBitAdam or ZeroOneAdam, got {type(optimizer).__name__}")
    model.register_comm_hook(optimizer, _ddp_hook)


def _ddp_hook(
    optimizer: OneBitOptimizer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    comm = optimizer.comm
    w = comm.world_size
    if w == 1 or not optimizer.needs_mean_grads():
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    optimizer._mean_ready = True
    comm.rounds += 1
    comm.bytes_sent += int(2 * (w - 1) / w * buffer.numel() * buffer.element_size())
    buffer.div_(w)
    work = dist.all_reduce(buffer, group=comm.group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


# torch checks the annotations of a comm hook by identity; postponed (string) annotations fail it.
_ddp_hook.__annotations__ = {
    "optimizer": OneBitOptimizer,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
