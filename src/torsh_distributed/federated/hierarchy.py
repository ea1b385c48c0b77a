"""Two-level aggregation: clients -> regional aggregators -> server (edge -> fog -> cloud).

With ``regions`` R the clients are dealt to R regions (contiguous blocks of partition ids). Each
region is a Flower federation of its own: a regional SuperLink with its clients' SuperNodes. The
server's SuperLink sees R *regional* SuperNodes instead of the clients. When the server's round k
reaches a region's node, its ClientApp (:func:`regional_round`) submits a one-round run to the
regional SuperLink (``flwr run``, the same apps): the region's clients train from the global
weights exactly as they would in round k of a flat run (``round_offset``), the regional server
averages them with FedAvg (FedProx's proximal term is passed on) weighted by samples, and the
region answers the server with that average and its total sample count. The server then applies
its own ``strategy`` to the regions' answers. With FedAvg at the top, full participation and
one local step, the result equals a flat run's (a test checks it); a region's traffic to the
server is one update instead of one per client.

:meth:`~torsh_distributed.federated.deploy.Federation.start_regions` starts the regional
SuperLinks and nodes of a local federation; over hosts each region would run the same processes
on its own host.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from torsh_distributed.federated.client import LocalResult
from torsh_distributed.federated.config import FederatedConfig

__all__ = ["regional_config", "regional_round"]


def regional_config(config: FederatedConfig, region: int, *, server_round: int, run_dir: Path) -> FederatedConfig:
    """The one-round run region ``region`` performs for the server's round ``server_round``."""
    members = config.region_members(region)
    return dataclasses.replace(
        config,
        rounds=1,
        regions=0,
        nodes=len(members),
        strategy="fedprox" if config.strategy == "fedprox" else "fedavg",
        min_clients=1,
        fraction=1.0,
        round_offset=server_round - 1,
        initial_state=str(run_dir / "initial.pt"),
        run_dir=str(run_dir),
        resume="never",
        metrics_port=0,
        dashboard_port=0,
        privacy=dataclasses.replace(config.privacy, noise_multiplier=0.0, delta=0.0),
    )


def regional_round(
    config: FederatedConfig,
    global_state: dict[str, torch.Tensor],
    *,
    region: int,
    server_round: int,
    superlink: str,
    proximal_mu: float = 0.0,
) -> LocalResult:
    """Region ``region``'s answer to the server's round ``server_round``: one round of its own
    clients on its SuperLink ``superlink`` from ``global_state``.

    Raises:
        RuntimeError: the regional run failed or no client of the region answered.
    """
    from torsh_distributed.federated.deploy import Federation

    del proximal_mu  # the regional run's own FedProx sends it to the clients
    run_dir = Path(config.run_dir) / "regions" / f"region{region}" / f"round_{server_round:05d}"
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save(global_state, run_dir / "initial.pt")
    sub = regional_config(config, region, server_round=server_round, run_dir=run_dir)
    started = time.perf_counter()
    fed = Federation(sub, local_nodes=False, echo=lambda _: None)
    fed._link_port = int(superlink.rpartition(":")[2])
    code = fed.submit(timeout=config.round_timeout)
    summary_path = run_dir / "summary.json"
    if code != 0 or not summary_path.exists():
        raise RuntimeError(f"region {region}'s round failed (flwr run exit {code}); logs in {run_dir / 'logs'}")
    summary = json.loads(summary_path.read_text())
    (record,) = summary["rounds"]
    if record["failed"]:
        raise RuntimeError(f"region {region}: no client answered by the deadline")
    state = torch.load(run_dir / "server" / "round_00001" / "model.pt", weights_only=True)
    examples = sum(c["examples"] for c in record["clients"])
    return LocalResult(
        state=state,
        num_examples=examples,
        loss=record["train_loss"],
        steps=max(c["steps"] for c in record["clients"]),
        straggler=False,
        seconds=time.perf_counter() - started,
        describe=f"region {region}: {record['answered']} of {record['sampled']} clients",
    )
