"""A Flower ``ServerApp`` of your own whose clients are torsh-distributed's engine.

Any Flower strategy drives ``torsh_distributed.federated.apps:client_app`` (named in this app's
pyproject.toml): ``engine_config`` puts the task (model, data, loss factories) and each client's
local training settings into the messages, and the client trains with the engine (DDP or ZeRO
inside a client with ``ClientConfig(nproc=...)``) and evaluates on its own share of the data.
The factories are this app's ``task.py``, named by file path: on other hosts, install them as a
module and name that (``mypkg.task:make_model``).
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from torsh_distributed.federated.apps import engine_config
from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.task import Task

app = ServerApp()

TASK = Path(__file__).with_name("task.py")


@app.main()
def main(grid: Grid, context: Context) -> None:
    rounds = int(context.run_config["num-server-rounds"])
    clients = int(context.run_config["num-clients"])
    config = FederatedConfig(
        clients=clients, rounds=rounds, partition="iid",
        task=TaskConfig(model=f"{TASK}:make_model", dataset=f"{TASK}:dataset"),
        client=ClientConfig(local_steps=5, batch_size=8, lr=0.3),
    )
    strategy = FedAvg(  # weighted by the clients' "num-examples"; every client trains and evaluates
        fraction_evaluate=1.0, min_train_nodes=clients, min_evaluate_nodes=clients, min_available_nodes=clients,
    )
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(Task(config).model().state_dict()), num_rounds=rounds,
        train_config=engine_config(config), evaluate_config=engine_config(config),
    )
    train = {r: dict(m) for r, m in result.train_metrics_clientapp.items()}
    evaluate = {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()}
    for r in sorted(train):
        print(f"flower_app: round {r} train loss {train[r]['loss']:.4f} "
              f"client eval loss {evaluate[r]['loss']:.4f}", flush=True)
    if context.run_config["result"]:
        Path(str(context.run_config["result"])).write_text(json.dumps({"train": train, "evaluate": evaluate}))
