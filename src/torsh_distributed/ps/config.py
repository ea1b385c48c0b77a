"""Configuration of the parameter server: its optimizer and its consistency / snapshot settings.

Both are kw-only dataclasses validated at construction; every bad value raises ``ValueError``
naming the field and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ServerOptimConfig", "PSConfig", "OPTIMIZERS", "check_clip_mean"]

OPTIMIZERS = ("sgd", "adagrad", "adam", "adamw")


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {value}")


@dataclass(kw_only=True, slots=True)
class ServerOptimConfig:
    """The optimizer each server applies to its own keys (torch.optim's update rules, fp64-exact).

    Sparse embedding rows are updated lazily: only rows that received a gradient move, and their
    optimizer state (momentum, accumulators, Adam's step count) is kept per row, as
    ``torch.optim.SparseAdam`` does. Dense keys follow ``torch.optim.SGD/Adagrad/Adam`` exactly.
    """

    kind: str = "adam"
    """``sgd`` (with ``momentum``), ``adagrad``, ``adam`` or ``adamw`` (``torch.optim.AdamW``:
    decoupled weight decay)."""
    lr: float = 1e-3
    """Learning rate (of every step unless ``lrs`` gives a schedule)."""
    lrs: tuple[float, ...] = ()
    """The learning rate of each step, 0-based (a warm-up and decay schedule: the engine's
    ``lr_at`` over the run, as ``torsh-dist train`` passes it); past its end the last value
    holds; empty = ``lr`` at every step. A server counts steps as the updates it applied
    (synchronous mode) or its pushes divided by the workers (SSP and asynchronous)."""
    momentum: float = 0.0
    """SGD momentum (``torch.optim.SGD``'s, dampening 0); ignored by the others (a warning)."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.999
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam / Adagrad denominator epsilon (Adagrad's default in torch is 1e-10: set it to match)."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient (torch's ``weight_decay``); ``adamw``: decoupled, the
    parameter shrinks by ``lr * weight_decay`` before the update."""
    decay_matrices_only: bool = False
    """Decay only keys of 2 or more dimensions (biases and norms not), as the engine groups its
    optimizer's parameters."""
    clip_norm: float = 0.0
    """Clip each push by its global L2 norm (over every key of one ``push()``, across all servers,
    computed by the worker before the push is split): the same as ``clip_grad_norm_`` on that
    worker's gradient. In synchronous mode each worker's gradient is clipped before averaging,
    unless ``clip_mean``. 0 = no clipping."""
    clip_mean: bool = False
    """Synchronous mode: clip the step's mean gradient (data parallelism's ``clip_grad_norm_``
    after the all-reduce) instead of each push. With several workers the server does it, so it
    needs one server (:func:`check_clip_mean` refuses more); with one worker its push is the
    mean."""

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"kind must be one of {OPTIMIZERS}, got {self.kind!r}")
        _positive("lr", self.lr)
        self.lrs = tuple(float(v) for v in self.lrs)
        for i, value in enumerate(self.lrs):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"lrs[{i}] must be >= 0 and finite, got {value}")
        _positive("momentum", self.momentum, allow_zero=True)
        _positive("eps", self.eps)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("clip_norm", self.clip_norm, allow_zero=True)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if self.momentum and self.kind != "sgd":
            import warnings

            warnings.warn(f"momentum={self.momentum} is ignored by kind={self.kind!r}", stacklevel=3)


@dataclass(kw_only=True, slots=True)
class PSConfig:
    """How servers and workers cooperate: consistency, snapshots, transport and security."""

    num_servers: int
    """Server processes; ranks ``0 .. num_servers-1`` of the world are servers, the rest workers."""
    staleness: int = 0
    """0 = synchronous (a step's update is applied once every worker pushed it: data-parallel
    averaging); s > 0 = bounded staleness (SSP: a pull waits while the worker's clock is more than
    s ahead of the slowest worker; each push is applied on arrival, scaled by 1/num_workers);
    -1 = fully asynchronous (never waits)."""
    snapshot_dir: str = ""
    """Directory of the servers' shard snapshots (``server-K/``); empty = no snapshots. A
    restarted server restores its latest snapshot from here."""
    snapshot_every: int = 0
    """Snapshot a shard every this many applied updates (pushes in async mode, steps in sync
    mode); 0 = only at the end."""
    host: str = "127.0.0.1"
    """Address the RPC agents listen on. The default keeps the servers on loopback; anything else
    exposes them and requires ``token``."""
    token: str = ""
    """Shared secret every call carries when ``host`` is not loopback. torch.distributed.rpc
    unpickles messages before this check runs, so the token separates jobs, it does not make
    untrusted peers safe: every peer must be trusted (see docs/parameter-server.md)."""
    timeout_s: float = 60.0
    """Per-call RPC timeout (a pull blocked by staleness counts against it)."""
    num_threads: int = 16
    """RPC worker threads per process (blocked pulls hold one each: keep above the workers)."""

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {self.num_servers}")
        if self.staleness < -1:
            raise ValueError(f"staleness must be -1 (async), 0 (sync) or > 0, got {self.staleness}")
        if self.snapshot_every < 0:
            raise ValueError(f"snapshot_every must be >= 0, got {self.snapshot_every}")
        if self.snapshot_every and not self.snapshot_dir:
            raise ValueError("snapshot_every > 0 needs snapshot_dir")
        _positive("timeout_s", self.timeout_s)
        if self.num_threads < 4:
            raise ValueError(f"num_threads must be >= 4, got {self.num_threads}")
        if not self.loopback and not self.token:
            raise ValueError(
                f"host={self.host!r} exposes the servers beyond this machine: set token (a shared "
                "secret) and trust every peer (torch.distributed.rpc unpickles its messages)"
            )

    @property
    def loopback(self) -> bool:
        """Whether the agents listen on loopback only."""
        return self.host in ("127.0.0.1", "localhost", "::1")

    @property
    def mode(self) -> str:
        """``sync``, ``ssp`` or ``async``."""
        return "sync" if self.staleness == 0 else "async" if self.staleness < 0 else "ssp"


def check_clip_mean(optim: ServerOptimConfig, ps: PSConfig, *, num_workers: int) -> None:
    """Refuse what synchronous clipping of the mean gradient cannot do: with several workers the
    mean exists only on the servers, and each holds part of it (its global norm is nowhere)."""
    if optim.clip_mean and optim.clip_norm and ps.staleness == 0 and num_workers > 1 and ps.num_servers > 1:
        raise ValueError(
            f"synchronous training through {ps.num_servers} servers with {num_workers} workers "
            "cannot clip the step's mean gradient by its global norm as data parallelism does "
            "(each server holds part of it): give --grad-clip 0, --ps-servers 1, or one worker"
        )
