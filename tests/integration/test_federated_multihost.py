"""A federation over simulated hosts (network namespaces, benchmarks/netlab): the SuperLink on host 0
listening on its own address, one SuperNode per client host started with ``torsh-dist
federated-node``; the round's messages cross the lab's links through the token-checking relays,
and the round is exact: FedAvg of 2 equal IID clients with one SGD step equals centralized SGD."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from netlab import NetLab, available  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from _federated_toy import centralized_sgd_step  # noqa: E402

REASON = available()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}"),
    pytest.mark.timeout(240),
]

CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
TOY = Path(__file__).with_name("_federated_toy.py")


def test_clients_on_other_hosts_join_with_the_token(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORSH_FEDERATED_TOKEN": "s3cret-for-the-lab"}
    with NetLab(hosts=3, rate_mbit=0, net=51) as lab:
        head = lab.address(0)
        server = lab.popen(
            0,
            [*CLI, "federated", "--model", f"{TOY}:make_model", "--dataset", f"{TOY}:dataset",
             "--val-dataset", f"{TOY}:dataset", "--clients", "2", "--rounds", "1", "--min-clients", "2",
             "--local-steps", "1", "--batch-size", "16", "--lr", "0.5", "--run-dir", str(tmp_path / "run"),
             "--superlink-host", head, "--superlink-port", "29700", "--remote-nodes",
             "--summary-json", str(tmp_path / "out.json"), "--timeout", "180",
             "--token-env", "TORSH_FEDERATED_TOKEN"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        for host in (1, 2):
            lab.popen(
                host,
                [*CLI, "federated-node", "--superlink", f"{head}:29700", "--partition-id", str(host - 1),
                 "--num-partitions", "2", "--token-env", "TORSH_FEDERATED_TOKEN"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        out, _ = server.communicate(timeout=200)
    text = out.decode(errors="replace")
    assert server.returncode == 0, text[-4000:]
    summary = json.loads((tmp_path / "out.json").read_text())
    (only,) = summary["rounds"]
    assert only["answered"] == 2 and [c["partition_id"] for c in only["clients"]] == [0, 1]
    assert f"SuperLink at {head}:29700" in text

    # FedAvg of the 2 equal IID clients, one local step of plain SGD each, equals one step of
    # centralized SGD on the union of their batches (the whole toy set), to 1e-5
    got = torch.load(tmp_path / "run" / "server" / "round_00001" / "model.pt", weights_only=True)
    for name, tensor in centralized_sgd_step(0.5).items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)
