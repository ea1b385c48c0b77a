"""A test-only Flower ``ServerApp``: one SecAgg+ round with :func:`secagg_round`, recording every
reply that reaches the server.

The SecAgg+ tests copy this file into the submitted app directory (Flower puts that directory on
the ServerApp's ``sys.path``). It reads the run's config from ``run_config["spec"]`` and its own
settings from ``secagg_test.json`` next to it, and writes into the run directory:
``secagg_result.pt`` (the new weights and the round's numbers), ``received.pt`` (every array that
arrived at the server) and, with ``pause_after``, ``paused.json`` (the nodes still in after that
stage; the round then waits for ``resume`` to appear, so the test can kill a client there).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from flwr.common import bytes_to_ndarray
from flwr.serverapp import Grid, ServerApp

from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.secagg import secagg_round
from torsh_distributed.federated.server import wait_for_clients
from torsh_distributed.federated.task import Task

server_app = ServerApp()


class RecordingGrid:
    """Delegates to the grid; keeps every array found in the replies (as the server got them),
    whether they are pulled one by one or through ``send_and_receive``."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.received: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Any]:
        return self._record(self.grid.send_and_receive(messages, timeout=timeout))

    def pull_messages(self, message_ids: Any) -> list[Any]:
        return self._record(self.grid.pull_messages(message_ids))

    def _record(self, replies: Any) -> list[Any]:
        replies = list(replies)
        for reply in replies:
            if reply.has_error():
                continue
            src = reply.metadata.src_node_id
            for key, record in reply.content.array_records.items():
                for name, array in record.items():
                    self._keep(src, f"{key}/{name}", array.numpy())
            for key, record in reply.content.config_records.items():
                for name, value in record.items():
                    for i, item in enumerate(value if isinstance(value, list) else [value]):
                        if isinstance(item, bytes):
                            try:
                                self._keep(src, f"{key}/{name}/{i}", bytes_to_ndarray(item))
                            except Exception:  # noqa: BLE001 - keys and shares are not arrays
                                continue
        return replies

    def _keep(self, src: int, where: str, array: Any) -> None:
        self.received.append({"src": src, "where": where, "array": torch.from_numpy(array.copy())})


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    spec = Path(str(context.run_config["spec"]))
    config = FederatedConfig.from_dict(json.loads(spec.read_text()))
    run_dir = Path(config.run_dir)
    settings = json.loads((run_dir / "secagg_test.json").read_text())
    wait_for_clients(grid, config.clients, timeout=120.0)
    node_ids = sorted(grid.get_node_ids())
    global_state = Task(config).model().state_dict()
    recorder = RecordingGrid(grid)

    def on_stage(stage: str, active: list[int]) -> None:
        print(f"federated: secagg stage {stage}: {len(active)} clients", flush=True)
        if stage == settings.get("pause_after"):
            (run_dir / "paused.json").write_text(json.dumps(active))
            deadline = time.monotonic() + 60
            while not (run_dir / "resume").exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    result = secagg_round(
        recorder,
        config=config,
        server_round=1,
        global_state=global_state,
        node_ids=node_ids,
        timeout=float(settings["timeout"]),
        num_shares=int(settings["num_shares"]),
        reconstruction_threshold=int(settings["threshold"]),
        clipping_range=float(settings.get("clipping_range", 8.0)),
        on_stage=on_stage,
    )
    numbers = {k: v for k, v in dataclasses.asdict(result).items() if k != "state"}
    torch.save({"state": result.state, "result": numbers}, run_dir / "secagg_result.pt")
    torch.save(recorder.received, run_dir / "received.pt")
    print(
        f"federated: secagg round done: {result.completed}/{result.sampled} in "
        f"{result.seconds:.1f} s (start-up {result.startup_seconds:.1f} s)",
        flush=True,
    )
