"""A measured profile of the target machine for the strategy planner (profile-guided planning).

Profile-guided planners (Alpa, Galvatron, Metis) time each layer under each parallel
configuration on the target hardware, time the collectives, then plan from those numbers
instead of a FLOP rate; Galvatron also times each layer wrapped as each data-parallel strategy
runs it, so that the sharding runtime's own cost (hooks, copies, re-sharding) is measured, not only
its collectives. :class:`Profile` holds such measurements as plain numbers (torch-free,
JSON-able); ``benchmarks/bench_planner.py`` measures one on micro-benchmarks (one block plain and
under FSDP2, one optimizer step, raw collectives) before any training run. The planner
(:mod:`torsh_distributed.plan._cost`) uses a profiled value wherever the profile has one and its
analytic model elsewhere, term by term.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Collective", "Profile"]

_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "p2p")
_TABLES = ("block", "outside", "fsdp_block", "fsdp_root")  # key -> micro-batch -> seconds


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective's measured cost over ``Profile.ranks`` ranks: ``alpha + bytes * beta``."""

    alpha: float
    """Seconds per call (latency, and the fixed cost of the library's call path)."""
    beta: float
    """Seconds per byte of the whole tensor (all-reduce, reduce-scatter input, all-gather
    output) or of the message (p2p, one way)."""

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(
                f"collective alpha and beta must be >= 0, got {self.alpha}, {self.beta}"
            )

    def time(self, nbytes: float, count: float = 1.0) -> float:
        """Seconds for ``count`` calls moving ``nbytes`` in all."""
        return count * self.alpha + nbytes * self.beta


def _per_micro_batch(table: dict[int, dict[int, float]], tp: int, micro_batch: int) -> float | None:
    """The entry at ``micro_batch``, else the nearest measured micro-batch scaled linearly."""
    row = table.get(tp)
    if not row:
        return None
    if micro_batch in row:
        return row[micro_batch]
    near = min(row, key=lambda b: (abs(b - micro_batch), -b))
    return row[near] * micro_batch / near


def _interpolated(row: dict[int, float], micro_batch: int) -> float:
    """``row`` at ``micro_batch``: linear between the measured micro-batches around it, the
    nearest one's value outside them (for costs that do not grow with the micro-batch, such as
    parameter gathers)."""
    below = [b for b in row if b <= micro_batch]
    above = [b for b in row if b >= micro_batch]
    if not below or not above:
        return row[min(row, key=lambda b: abs(b - micro_batch))]
    lo, hi = max(below), min(above)
    if lo == hi:
        return row[lo]
    return row[lo] + (row[hi] - row[lo]) * (micro_batch - lo) / (hi - lo)


@dataclass(kw_only=True, slots=True)
class Profile:
    """Measured per-layer, optimizer and collective costs of one model shape on one machine.

    Tables are keyed by the tensor-parallel degree (the FSDP2 ones by the ZeRO stage), then the
    micro-batch (sequences); a micro-batch not measured is scaled linearly from the nearest one
    measured (the FSDP2 overheads, which do not grow with it, are interpolated), a tp degree or
    stage not measured falls back to the analytic model (FLOPs / ``device_flops``, alpha-beta
    rings, or the profiled raw collectives).
    """

    hidden: int
    """Width of the model the blocks were timed on (must equal the plan's ``hidden``)."""
    seq_len: int
    """Sequence length of the timed micro-batches (must equal the plan's ``seq_len``)."""
    ranks: int = 2
    """Ranks the collectives were timed on (groups of other sizes use the analytic model); at
    tp > 1 the blocks ran on ``tp`` ranks, and at tp 1 this many ranks ran them at once, as the
    data-parallel replicas share the machine."""
    block: dict[int, dict[int, float]] = field(default_factory=dict)
    """Seconds of forward + backward of ONE transformer block: tp -> micro-batch -> s. At tp > 1
    through the model's tensor-parallel plan: its all-reduces are inside this time."""
    outside: dict[int, dict[int, float]] = field(default_factory=dict)
    """Seconds of forward + backward of everything outside the blocks (embeddings, final norm,
    head, loss): tp -> micro-batch -> s."""
    solo: dict[int, float] = field(default_factory=dict)
    """Seconds of forward + backward of ONE tp-1 block run by one rank while the other ranks
    wait: micro-batch -> s. Where ranks share the machine's cores (a CPU host), a rank alone runs
    faster than ``block[1]`` (all ranks at once); a pipeline's fill and drain run with stages
    idle, so its bubble costs less than its busy slots. Empty: no such difference."""
    optimizer: dict[int, float] = field(default_factory=dict)
    """Seconds per local parameter of one optimizer step (gradient clipping included), as the
    engine runs it at that tp (replicated parameters, or tp shards)."""
    optimizer_sharded: float | None = None
    """Seconds per local parameter of the step on ZeRO-2/3 (FSDP2) shards; ``None`` = the tp
    entry."""
    optimizer_pipeline: float | None = None
    """Seconds per local parameter of the step on a pipeline stage at tp 1: the engine clips a
    model-parallel run's gradients tensor by tensor (and sums the norm over the stages), which
    costs more than the fused clipping of ``optimizer[1]``; ``None`` = ``optimizer[1]``."""
    fsdp_block: dict[int, dict[int, float]] = field(default_factory=dict)
    """Seconds ONE transformer block's forward + backward takes under FSDP2 at tp 1 beyond the
    plain block (``block[1]``), as the engine wraps it (one unit per block below the root, over
    ``ranks`` ranks): ZeRO stage (2, 3) -> micro-batch -> s. The block's all-gathers and
    reduce-scatter, its hooks, the copies into and out of the flat buffers and the re-sharding
    are all inside it; replaces the raw collective fits for such a group."""
    fsdp_root: dict[int, dict[int, float]] = field(default_factory=dict)
    """The same for the root unit (the parameters outside the blocks) beyond ``outside[1]``,
    with FSDP2's once-per-step root work: stage -> micro-batch -> s."""
    all_reduce: Collective | None = None
    reduce_scatter: Collective | None = None
    all_gather: Collective | None = None
    p2p: Collective | None = None
    """One-way send/recv between two ranks (pipeline activations and their gradients)."""
    source: str = ""
    """How and where it was measured (free text, reported with the plan)."""

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.seq_len < 1 or self.ranks < 1:
            raise ValueError("profile hidden, seq_len and ranks must be >= 1")
        for name in _TABLES:
            for key, row in getattr(self, name).items():
                if key < 1 or any(b < 1 or t < 0 for b, t in row.items()):
                    raise ValueError(
                        f"profile {name}[{key}]: degrees and micro-batches >= 1, times >= 0"
                    )
        for name in ("fsdp_block", "fsdp_root"):
            if set(getattr(self, name)) - {2, 3}:
                raise ValueError(f"profile {name}: keyed by ZeRO stage 2 or 3")
        if {k: set(v) for k, v in self.fsdp_block.items()} != {
            k: set(v) for k, v in self.fsdp_root.items()
        }:
            raise ValueError(
                "profile fsdp_block and fsdp_root must cover the same stages and micro-batches"
            )
        if any(b < 1 or t <= 0 for b, t in self.solo.items()):
            raise ValueError("profile solo: micro-batches >= 1, times > 0")
        if any(tp < 1 or t < 0 for tp, t in self.optimizer.items()):
            raise ValueError("profile optimizer: degrees >= 1, times >= 0")
        for name in ("optimizer_sharded", "optimizer_pipeline"):
            if (getattr(self, name) or 0.0) < 0:
                raise ValueError(f"profile {name} must be >= 0")

    def block_time(self, tp: int, micro_batch: int) -> float | None:
        """Seconds of one block's forward + backward, or ``None`` if ``tp`` was not profiled."""
        return _per_micro_batch(self.block, tp, micro_batch)

    def outside_time(self, tp: int, micro_batch: int) -> float | None:
        return _per_micro_batch(self.outside, tp, micro_batch)

    def solo_ratio(self, tp: int, micro_batch: int) -> float:
        """Time of a block run by one rank alone over its time with all ranks busy (``solo`` /
        ``block[1]``, clamped to [0.5, 1]: a rank alone is never slower, nor faster than twice);
        1.0 at tp > 1 (tensor-parallel ranks always run together) or where not profiled."""
        busy = self.block_time(1, micro_batch)
        if tp != 1 or not self.solo or not busy:
            return 1.0
        alone = _per_micro_batch({1: self.solo}, 1, micro_batch)
        assert alone is not None
        return min(1.0, max(0.5, alone / busy))

    def optimizer_time(
        self, tp: int, params: float, *, sharded: bool, pipeline: bool = False
    ) -> float | None:
        """Seconds of the step on ``params`` local parameters (``None``: ``tp`` not profiled).

        ``sharded``: on ZeRO-2/3 shards; ``pipeline``: on a pipeline stage (at tp 1 the engine's
        model-parallel clipping). Each falls back to the plain entry of ``tp`` if not profiled.
        """
        per = self.optimizer_sharded if sharded else None
        if per is None and pipeline and tp == 1:
            per = self.optimizer_pipeline
        per = per if per is not None else self.optimizer.get(tp)
        return None if per is None else per * params

    def fsdp_overhead(self, stage: int, micro_batch: int) -> tuple[float, float] | None:
        """``(per block, root)`` seconds of one micro-batch's forward + backward under FSDP2 at
        ``stage`` beyond the plain model (tp 1, ``ranks`` ranks), or ``None`` if not profiled.
        Between measured micro-batches interpolated linearly, outside them the nearest: the
        gathers and reduce-scatters move parameters, whatever the micro-batch."""
        if stage not in self.fsdp_block or not self.fsdp_block[stage]:
            return None
        return (
            _interpolated(self.fsdp_block[stage], micro_batch),
            _interpolated(self.fsdp_root[stage], micro_batch),
        )

    def collective(self, kind: str, ranks: int) -> Collective | None:
        """The measured ``kind`` (all_reduce, reduce_scatter, all_gather, p2p) for a group of
        ``ranks``, or ``None`` (not measured, or measured on another group size)."""
        assert kind in _COLLECTIVES, kind
        if kind == "p2p":  # always between two ranks
            return self.p2p
        return getattr(self, kind) if ranks == self.ranks else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Inverse of :meth:`to_dict`, also after a JSON round trip (string keys)."""
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {', '.join(sorted(unknown))}")
        kw = dict(data)
        for name in _TABLES:
            kw[name] = {
                int(tp): {int(b): float(t) for b, t in row.items()}
                for tp, row in kw.get(name, {}).items()
            }
        kw["optimizer"] = {int(tp): float(t) for tp, t in kw.get("optimizer", {}).items()}
        kw["solo"] = {int(b): float(t) for b, t in kw.get("solo", {}).items()}
        for name in _COLLECTIVES:
            if kw.get(name) is not None:
                kw[name] = Collective(**kw[name])
        return cls(**kw)
