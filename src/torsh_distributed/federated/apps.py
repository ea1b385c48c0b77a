"""Flower's ``ServerApp`` and ``ClientApp`` of a torsh-dist federated run.

The deployment engine loads them by name (``torsh_distributed.federated.apps:server_app`` and
``:client_app``, from the app that :mod:`~torsh_distributed.federated.deploy` submits). The server
reads the run's config from the JSON file ``run_config["spec"]`` names (on the SuperLink's host)
and runs :class:`~torsh_distributed.federated.server.RoundLoop`; each round's message carries
the config as JSON, so a client on another host needs only its ``partition-id`` and
``num-partitions`` (Flower's node config, set when its SuperNode starts).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.updates import ctx_key

__all__ = ["client_app", "engine_config", "server_app"]

_CLIP = "clipping_norm"  # flwr.supercore.differential_privacy.KEY_CLIPPING_NORM
_EF = "torsh-ef"  # this node's error-feedback residuals, kept across rounds by Flower

client_app = ClientApp()
server_app = ServerApp()


def engine_config(config: FederatedConfig) -> ConfigRecord:
    """The ``train_config``/``evaluate_config`` a ServerApp of your own sends so that
    :data:`client_app` (the engine) trains and evaluates ``config``'s task and client settings:
    ``strategy.start(grid=grid, initial_arrays=..., train_config=engine_config(cfg),
    evaluate_config=engine_config(cfg))`` with any Flower strategy (docs/federated.md)."""
    return ConfigRecord({"spec": config.to_json()})


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    from torsh_distributed.federated.client import node_partition, train_round

    config_record = msg.content["config"]
    config = FederatedConfig.from_dict(json.loads(str(config_record["spec"])))
    server_round = int(config_record["server-round"]) + config.round_offset
    mu = float(config_record["proximal-mu"]) if "proximal-mu" in config_record else 0.0
    global_state = msg.content["arrays"].to_torch_state_dict()
    if "region-id" in context.node_config:  # a regional aggregator: one round of its own clients
        from torsh_distributed.federated.hierarchy import regional_round

        region = int(context.node_config["region-id"])
        result = regional_round(
            config, global_state, region=region, server_round=server_round,
            superlink=str(context.node_config["region-superlink"]), proximal_mu=mu,
        )  # fmt: skip
        pid = region  # the server's per-client rows mark it "region"
    else:
        pid = node_partition(context.node_config, config.clients)
        result = train_round(config, global_state, partition_id=pid, server_round=server_round, proximal_mu=mu)
    state = result.state
    if _CLIP in config_record:  # client-side clipping of DP: clip the update before it leaves
        state = _clip(global_state, state, float(config_record[_CLIP]))
    metrics = MetricRecord(
        {
            "weight": result.num_examples,
            "num-examples": result.num_examples,
            "partition-id": pid,
            "loss": result.loss,
            "steps": result.steps,
            "seconds": result.seconds,
            "straggler": int(result.straggler),
            **({"region": 1} if "region-id" in context.node_config else {}),
        }
    )
    content = RecordDict({"metrics": metrics})
    method = str(config_record["compression"]) if "compression" in config_record else config.compression
    if method == "none":
        content["arrays"] = ArrayRecord(state)
    else:
        content["arrays"], content[ctx_key()] = _compress(config, method, global_state, state, context)
    return Message(content=content, reply_to=msg)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    """Client-side evaluation: the global model's loss (and accuracy) on this client's own data
    (a fixed sample of at most 256 items), weighted by the items evaluated."""
    from torsh_distributed.federated.client import node_partition
    from torsh_distributed.federated.task import _EVAL_BATCH, _EVAL_BATCHES, Task, evaluate

    config = FederatedConfig.from_dict(json.loads(str(msg.content["config"]["spec"])))
    pid = node_partition(context.node_config, config.clients)
    task = Task(config)
    model = task.model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = task.client_data(pid).dataset
    metrics = evaluate(model, data, task.loss(), seed=config.seed)
    count = min(len(data), _EVAL_BATCH * _EVAL_BATCHES)
    record = MetricRecord({"weight": count, "num-examples": count, "partition-id": pid, **metrics})
    return Message(content=RecordDict({"metrics": record}), reply_to=msg)


def _clip(global_state: dict[str, torch.Tensor], state: dict[str, torch.Tensor], norm: float) -> dict[str, torch.Tensor]:
    from torsh_distributed.federated.privacy import clip_update

    delta = {k: v - global_state[k] for k, v in state.items() if v.is_floating_point()}
    clipped, _ = clip_update(delta, norm)
    return {k: global_state[k] + clipped[k] if k in clipped else v for k, v in state.items()}


def _compress(
    config: FederatedConfig,
    method: str,
    global_state: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    context: Context,
) -> tuple[ArrayRecord, ConfigRecord]:
    """The update encoded with ``method``; error-feedback residuals stay in this node's
    ``Context.state`` (also across a change of method: they are plain per-tensor values)."""
    from torsh_distributed.federated.updates import UpdateCodec

    codec = UpdateCodec(method, error_feedback=config.error_feedback, seed=config.seed)
    residuals = context.state[_EF].to_torch_state_dict() if _EF in context.state else {}
    payload, ctx, residuals = codec.encode(global_state, state, residuals)
    if residuals:
        context.state[_EF] = ArrayRecord(residuals)
    return ArrayRecord(payload), ConfigRecord({"json": ctx})


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    from torsh_distributed.federated.server import RoundLoop

    spec = Path(str(context.run_config["spec"]))
    config = FederatedConfig.from_dict(json.loads(spec.read_text()))
    started = time.time()
    from torsh_distributed.federated.hooks import FederatedHooks

    summary = RoundLoop(config, grid, log=_log, hooks=FederatedHooks(config)).run()
    _log(f"federated: done in {time.time() - started:.1f} s, summary {Path(config.run_dir) / 'summary.json'}")
    del summary


def _log(line: str) -> None:
    print(line, flush=True)
