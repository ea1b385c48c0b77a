"""The simulator's network: which link a process group uses, and what its collectives cost.

Hierarchical: devices of a node talk over ``--intra-bw`` (NVLink/NVSwitch); a group spanning
nodes shares each node's NICs (``--inter-bw``, all NICs of a node) with the other groups on that
node that run the same collective at the same time (the strategy planner's ``_cost._link``). On
top of it the topology between nodes: ``rail`` (rail-optimised: GPU i of every node on rail
switch i, full bisection) or ``fat-tree`` with ``oversubscription`` R (the inter-node bandwidth of
a group divided by R). Collective times are the alpha-beta ring models of
:class:`torsh_distributed.comm.cost_model.CostModel`: all-reduce ``2 (n-1) (alpha + B / (n bw))``;
reduce-scatter and all-gather are half of it (``n - 1`` steps of ``B / n``), an all-to-all the
same ``(n - 1) / n`` of the bytes per rank; with the ``gloo`` backend a reduce-scatter costs an
all-reduce (torch's Gloo reduce-scatter, timed on the network lab). Different groups' collectives running at the same
time on one NIC are not modelled beyond that share (no contention between, e.g., a pipeline
send and a data-parallel all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torsh_distributed.comm.cost_model import CostModel, LinkCost
from torsh_distributed.plan._cost import Link, _link

if TYPE_CHECKING:
    from torsh_distributed.plan._strategy_config import StrategyConfig

__all__ = ["BACKENDS", "TOPOLOGIES", "Network"]

TOPOLOGIES = ("rail", "fat-tree")
BACKENDS = ("nccl", "gloo")
_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


@dataclass(frozen=True, slots=True)
class Network:
    """Links and collective costs of one cluster (``cfg``'s bandwidths, latencies, node size)."""

    cfg: StrategyConfig
    topology: str = "rail"
    oversubscription: float = 1.0
    backend: str = "nccl"

    def link(self, size: int, stride: int) -> Link:
        """The link of a group of ``size`` ranks ``stride`` apart (ranks numbered node by node)."""
        link = _link(self.cfg, size, stride)
        if link.kind == "inter" and self.topology == "fat-tree" and self.oversubscription > 1:
            link = Link(
                alpha=link.alpha, bandwidth=link.bandwidth / self.oversubscription, kind="inter"
            )
        return link

    def collective(self, op: str, nbytes: float, size: int, stride: int) -> float:
        """Seconds of one ``op`` of ``nbytes`` (the whole tensor) over the group."""
        assert op in _OPS, op
        if size <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(size, stride)
        cost = LinkCost(alpha=link.alpha, beta=1.0 / link.bandwidth)
        model = CostModel(intra=cost, inter=cost)
        ring = model.estimate("ring", int(nbytes), ranks=size, nodes=1)
        full = op == "all_reduce" or (op == "reduce_scatter" and self.backend == "gloo")
        return ring if full else ring / 2

    def p2p(self, nbytes: float, stride: int) -> float:
        """Seconds of one send of ``nbytes`` to the rank ``stride`` away."""
        link = self.link(2, stride)
        return link.alpha + nbytes / link.bandwidth
