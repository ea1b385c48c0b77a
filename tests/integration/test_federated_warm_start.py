"""ClientApps that start warm (:mod:`torsh_distributed.federated._warm_node`), for real on
Flower's deployment engine, with a user's own Flower app (``_federated_probe_app``: nothing of
torsh_distributed in it). Two messages to one SuperNode:

- with ``start_method="forkserver"`` (the default) every message is still handled by a process of
  its own, named ``flwr-clientapp`` and fresh (the app's module state starts anew), but torch was
  imported before Flower loaded the app: the process was forked from the federation's preloaded
  server, as was the run's ServerApp (``flwr-serverapp``);
- with ``spawn`` (Flower's own SuperExec) the same probe sees torch imported only by the app: the
  control that shows the probe tells the two apart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from torsh_distributed.federated.config import FederatedConfig
from torsh_distributed.federated.deploy import Federation

pytestmark = pytest.mark.timeout(400)

APP = Path(__file__).with_name("_federated_probe_app")


def _probe(
    tmp_path: Path, start_method: str, *, messages: int = 2, nodes: int = 1
) -> tuple[list[dict[str, float]], dict[str, int], dict[str, int]]:
    """The replies, the pids of the processes the federation started (by name), and how the
    ServerApp's process started."""
    app = tmp_path / start_method / "app"
    shutil.copytree(APP, app)
    result = tmp_path / start_method / "replies.json"
    config = FederatedConfig(clients=nodes, run_dir=str(tmp_path / start_method / "run"))
    lines: list[str] = []
    fed = Federation(config, echo=lines.append, start_method=start_method)
    with fed.running():
        pids = {name: proc.pid for name, proc in fed.procs.items()}
        code = fed.submit(timeout=300, app=app,
                          run_config=f'messages={messages} nodes={nodes} result="{result}"')  # fmt: skip
    assert code == 0, lines
    replies = json.loads(result.read_text())
    assert len(replies) == messages * nodes
    return replies, pids, json.loads(result.with_suffix(".server.json").read_text())


def test_each_message_gets_a_fresh_clientapp_process_forked_with_torch_already_imported(tmp_path: Path) -> None:
    """Two nodes, two messages each: four fresh processes, all forked from the one forkserver the
    federation started for its local nodes (``clientapps``), none from a server per node."""
    replies, pids, server = _probe(tmp_path, "forkserver", nodes=2)
    assert [r["torch-before-app"] for r in replies] == [1, 1, 1, 1]
    assert len({r["pid"] for r in replies}) == 4  # a process per message, as Flower's own
    assert [r["handled"] for r in replies] == [1, 1, 1, 1]  # nothing of an earlier process left
    assert all(r["named-flwr-clientapp"] and r["torch-ok"] for r in replies)
    assert {r["ppid"] for r in replies} == {pids["clientapps"]}
    # the SuperLink's ServerApp: forked from the same server, by the SuperLink's own SuperExec
    assert server == {"torch-before-app": 1, "pid": server["pid"], "ppid": pids["clientapps"],
                      "named-flwr-serverapp": 1}  # fmt: skip
    assert "superlink-serverapps" in pids


def test_flowers_own_superexec_starts_clientapps_cold(tmp_path: Path) -> None:
    replies, pids, server = _probe(tmp_path, "spawn")
    assert "clientapps" not in pids and "superlink-serverapps" not in pids
    assert server["torch-before-app"] == 0 and server["named-flwr-serverapp"] == 1
    assert [r["torch-before-app"] for r in replies] == [0, 0]
    assert len({r["pid"] for r in replies}) == 2
    assert all(r["named-flwr-clientapp"] and r["torch-ok"] for r in replies)

