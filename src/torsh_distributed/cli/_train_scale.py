"""Carbon-aware scaling's launch for ``torsh-dist train``: ``--nproc-per-node MIN:MAX`` or
``--nnodes MIN:MAX`` with ``--carbon.scale`` runs the job in segments, each at the size the
carbon-intensity series asks for (:mod:`torsh_distributed.elastic.resize`)."""

from __future__ import annotations

import argparse
import time
import typing
from collections.abc import Callable
from typing import Any

if typing.TYPE_CHECKING:
    from torsh_distributed.engine.user import UserFactories
    from torsh_distributed.train.config import TrainConfig

__all__ = ["Scaled", "scale_range", "launch_scaled"]


class Scaled(typing.NamedTuple):
    """The range of carbon-aware scaling: workers of one node, or whole nodes."""

    low: int
    high: int
    nodes: bool
    """True: ``--nnodes MIN:MAX`` (each node ``--nproc-per-node`` workers); False:
    ``--nproc-per-node MIN:MAX`` on one node."""


def _parse_range(flag: str, text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"{flag} MIN:MAX must be two integers, got {text!r}") from None
    if not 1 <= low < high:
        raise ValueError(f"{flag} MIN:MAX must satisfy 1 <= MIN < MAX, got {text!r}")
    return low, high


def scale_range(args: argparse.Namespace, config: TrainConfig) -> Scaled | None:
    """The range of carbon-aware scaling (``args`` then holds its MAX), or ``None``;
    ``ValueError`` for a worker range without ``--carbon.scale`` or the converse."""
    text, nodes = str(args.nproc_per_node), str(args.nnodes)
    if config.carbon.scale and ":" in nodes and ":" not in text:  # whole nodes
        low, high = _parse_range("--nnodes", nodes)
        if getattr(args, "rdzv_endpoint", None) or getattr(args, "ps_servers", 0):
            raise ValueError(
                "--carbon.scale over --nnodes MIN:MAX launches each segment itself (node 0 at "
                "--master-addr/--master-port coordinates): drop --rdzv-endpoint / --ps-servers"
            )
        args.nnodes = str(high)
        return Scaled(low, high, nodes=True)
    if ":" not in text:
        if config.carbon.scale:
            raise ValueError(
                "--carbon.scale needs the range to scale between: --nproc-per-node MIN:MAX (workers "
                "of one node, for example 1:4) or --nnodes MIN:MAX (whole nodes)"
            )
        return None
    if not config.carbon.scale:
        raise ValueError(
            f"--nproc-per-node {text} is a range for carbon-aware scaling: add --carbon.scale "
            "(with --carbon.series FILE); an elastic range of nodes is --nnodes MIN:MAX"
        )
    low, high = _parse_range("--nproc-per-node", text)
    if nodes not in ("1", "1:1") or getattr(args, "ps_servers", 0):
        raise ValueError(
            "--carbon.scale over --nproc-per-node MIN:MAX scales the workers of one node: for "
            f"several nodes scale whole nodes (--nnodes MIN:MAX), not with --nnodes {nodes} or --ps-servers"
        )
    args.nproc_per_node = str(high)
    return Scaled(low, high, nodes=False)


def launch_scaled(
    config: TrainConfig,
    user: UserFactories | None,
    options: Any,
    scaled: Scaled,
    *,
    check_world: Callable[[TrainConfig, int, UserFactories | None], None],
) -> int:
    """Carbon-aware scaling: the job in segments, each at the size the series asks for."""
    from torsh_distributed.elastic.resize import launch_resizing, launch_resizing_nodes
    from torsh_distributed.energy.refresh import SeriesWatch
    from torsh_distributed.energy.shift import clock_text

    unit = options.nproc_per_node if scaled.nodes else 1
    flag = "--nnodes" if scaled.nodes else "--nproc-per-node"
    runnable, skipped = [], []
    for count in range(scaled.low, scaled.high + 1):  # every size the job may run at, before any rank starts
        try:
            check_world(config, count * unit, user)
            runnable.append(count * unit)
        except ValueError as exc:
            if count in (scaled.low, scaled.high):
                raise ValueError(f"{flag} {scaled.low}:{scaled.high} at {count * unit} workers: {exc}") from None
            skipped.append(f"{count * unit} ({exc})")
    if skipped:
        print(f"torsh-dist: carbon scaling skips world size {'; '.join(skipped)}", flush=True)
    policy = config.carbon.scale_policy(runnable)
    # here, not at config construction: a later segment may start after the series' end
    policy.check(time.time())
    watch = (SeriesWatch(config.carbon.series, lambda: config.carbon.scale_policy(runnable),
                         lambda line: print(f"torsh-dist: {line}", flush=True))
             if config.carbon.refresh > 0 else None)

    def choose(now: float) -> tuple[int, dict[str, Any]]:
        nonlocal policy
        if watch is not None and (fresh := watch()) is not None:  # each segment: the series now
            policy = fresh
        target = policy.target(now)
        where = (f"intensity {target.intensity:g} g/kWh" if target.intensity is not None
                 else "outside the series")
        return target.world_size, {"intensity": target.intensity,
                                   "text": f"carbon: {where} at {clock_text(now)}"}

    job = {"module": "torsh_distributed.train",
           "args": ["--config-json", config.to_json(), *(user.to_args() if user else [])]}
    if scaled.nodes:
        return launch_resizing_nodes(options, choose=choose, node_counts=[n // unit for n in runnable], **job)
    return launch_resizing(options, choose=choose, sizes=runnable, **job)
