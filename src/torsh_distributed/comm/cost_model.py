"""Alpha-beta cost model of the collective algorithms, measured per link class, and ``"auto"``.

A message of ``n`` bytes over a link costs ``alpha + n * beta``. :func:`probe` measures alpha and
beta for the two link classes of a job (inside a node and between nodes) with timed ping-pongs;
:meth:`CostModel.choose` predicts each algorithm's all-reduce time from them and picks the
fastest. Every decision is kept (``CostModel.decisions``) and the first of each kind is logged.
Torch is imported only by :func:`probe_link`, so the planners (``plan simulate``) reuse the model
without it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["LinkCost", "Decision", "CostModel", "probe_link", "NATIVE_DISCOUNT"]

log = logging.getLogger(__name__)

NATIVE_DISCOUNT = 0.5
"""The backend's own all-reduce is modelled as a ring whose per-message latency is this fraction of
the measured (Python point-to-point) alpha: Gloo and NCCL run their rings in C++."""


@dataclass(frozen=True, slots=True)
class LinkCost:
    """Cost of one message on a link class: ``alpha + bytes * beta`` seconds."""

    alpha: float
    """Latency per message, seconds."""
    beta: float
    """Seconds per byte (1 / bandwidth)."""

    def time(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return 1.0 / self.beta if self.beta > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Decision:
    """One ``"auto"`` choice: what was predicted and what was picked."""

    op: str
    nbytes: int
    ranks: int
    nodes: int
    chosen: str
    estimates: dict[str, float]


@dataclass(slots=True)
class CostModel:
    """Predicts collective times from per-link-class alpha/beta; picks algorithms for ``"auto"``."""

    intra: LinkCost = field(default_factory=lambda: LinkCost(alpha=50e-6, beta=1 / 2e9))
    """Link between ranks of one node (defaults: a loopback guess until :func:`probe_link`)."""
    inter: LinkCost = field(default_factory=lambda: LinkCost(alpha=100e-6, beta=1 / 1.25e9))
    """Link between nodes (defaults: 10 GbE guess)."""
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=1024))
    """The most recent decisions, oldest first."""
    _logged: set[tuple[str, int, int, str]] = field(default_factory=set)

    def estimate(self, algorithm: str, nbytes: int, *, ranks: int, nodes: int) -> float:
        """Predicted seconds of an all-reduce of ``nbytes`` over ``ranks`` ranks on ``nodes`` nodes.

        Ranks are assumed spread evenly and numbered node by node (a ring crosses each node
        boundary once per direction).
        """
        p, m = ranks, max(nodes, 1)
        if p <= 1:
            return 0.0
        slow = self.inter if m > 1 else self.intra
        if algorithm in ("ring", "torch"):
            alpha = slow.alpha * (NATIVE_DISCOUNT if algorithm == "torch" else 1.0)
            return 2 * (p - 1) * (alpha + nbytes / p * slow.beta)
        if algorithm == "tree":
            return 2 * math.ceil(math.log2(p)) * slow.time(nbytes)
        if algorithm == "hierarchical":
            per_node = p // m
            intra = 2 * (per_node - 1) * self.intra.time(nbytes / per_node)
            # per_node concurrent inter-node rings, each on 1/per_node of the data, share a link
            inter = 2 * (m - 1) * (self.inter.alpha + nbytes / m * self.inter.beta)
            return intra + inter
        raise ValueError(f"no cost model for algorithm {algorithm!r}")

    def choose(
        self,
        op: str,
        nbytes: int,
        *,
        ranks: int,
        nodes: int,
        candidates: tuple[str, ...] = ("torch", "ring", "tree", "hierarchical"),
    ) -> str:
        """The candidate with the smallest predicted time; recorded in :attr:`decisions`."""
        usable = [c for c in candidates if c != "hierarchical" or (nodes > 1 and ranks > nodes)]
        estimates = {c: self.estimate(c, nbytes, ranks=ranks, nodes=nodes) for c in usable}
        chosen = min(estimates, key=estimates.__getitem__)
        self.decisions.append(
            Decision(
                op=op, nbytes=nbytes, ranks=ranks, nodes=nodes, chosen=chosen, estimates=estimates
            )
        )
        key = (op, max(nbytes, 1).bit_length(), ranks, chosen)
        if key not in self._logged:
            self._logged.add(key)
            pretty = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(estimates.items()))
            log.info(
                "auto %s of %d B on %d ranks / %d nodes -> %s (%s)",
                op,
                nbytes,
                ranks,
                nodes,
                chosen,
                pretty,
            )
        return chosen

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {
            "intra": {"alpha": self.intra.alpha, "beta": self.intra.beta},
            "inter": {"alpha": self.inter.alpha, "beta": self.inter.beta},
        }


def probe_link(
    a: int,
    b: int,
    *,
    small: int = 1024,
    large: int = 1 << 20,
    repeats: int = 3,
) -> LinkCost | None:
    """Ping-pong between global ranks ``a`` and ``b``; collective (every rank calls it).

    Returns the measured :class:`LinkCost` on every rank (broadcast from ``a``), or ``None`` when
    ``a == b``. Each one-way time is the best of ``repeats`` round trips / 2.
    """
    if a == b:
        return None
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    result = torch.zeros(2, dtype=torch.float64)
    if me in (a, b):
        peer = b if me == a else a
        times = []
        for size in (small, large):
            buf = torch.zeros(max(size // 4, 1), dtype=torch.float32)
            best = math.inf
            for _ in range(repeats + 1):  # first round trip warms the connection up
                start = time.perf_counter()
                if me == a:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                best = min(best, (time.perf_counter() - start) / 2)
            times.append(best)
        beta = max((times[1] - times[0]) / (large - small), 1e-12)
        alpha = max(times[0] - small * beta, 1e-7)
        result = torch.tensor([alpha, beta], dtype=torch.float64)
    dist.broadcast(result, src=a)
    return LinkCost(alpha=float(result[0]), beta=float(result[1]))
