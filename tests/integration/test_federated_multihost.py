"""A federation over simulated hosts (network namespaces, benchmarks/netlab): the SuperLink on host 0
listening on its own address, one SuperNode per client host started with ``torsh-dist
federated-node``; the round's messages cross the lab's links through the relays, and the round is
exact: FedAvg of 2 equal IID clients with one SGD step equals centralized SGD.

The same round twice, captured by tcpdump on the lab's switch: ``--insecure`` (token only: the
global model's bytes are readable on the wire, which shows the capture can see them) and with TLS
by default (the head makes the federation's CA; the nodes present its certificates): no tensor
bytes and no token on the wire, the same model and losses. During the TLS round a node presenting
another CA's certificate and a node trusting another CA are refused, each with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from netlab import NetLab, available  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from _federated_toy import centralized_sgd_step, make_model  # noqa: E402

REASON = available()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"network lab unavailable: {REASON}"),
    pytest.mark.timeout(420),
]

CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
TOY = Path(__file__).with_name("_federated_toy.py")
TOKEN = "s3cret-for-the-lab"


def _model_windows() -> list[bytes]:
    """12-byte windows of the initial global model's first weight (what the server sends down)."""
    from torsh_distributed.federated.config import FederatedConfig, TaskConfig
    from torsh_distributed.federated.task import Task

    task = TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset")
    model = Task(FederatedConfig(partition="iid", clients=2, task=task)).model()
    assert isinstance(model, type(make_model()))
    raw = model.state_dict()["0.weight"].numpy().tobytes()
    return [raw[i : i + 12] for i in range(0, len(raw) - 12, 12)]


def _round(lab: NetLab, run: Path, *, tls: bool, bad_nodes: bool) -> tuple[dict, str, bytes, list[str]]:
    """One round with 2 client hosts; returns the summary, the head's output, the capture and
    the bad nodes' stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORSH_FEDERATED_TOKEN": TOKEN}
    head = lab.address(0)
    pcap = run.parent / f"{run.name}.pcap"
    capture = subprocess.Popen(
        ["ip", "netns", "exec", lab.switch, "tcpdump", "-i", "br0", "-U", "-s", "0", "-w", str(pcap)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not pcap.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        security = [] if tls else ["--insecure"]
        server = lab.popen(
            0,
            [*CLI, "federated", "--model", f"{TOY}:make_model", "--dataset", f"{TOY}:dataset",
             "--val-dataset", f"{TOY}:dataset", "--clients", "2", "--rounds", "1", "--min-clients", "2",
             "--local-steps", "1", "--batch-size", "16", "--lr", "0.5", "--run-dir", str(run),
             "--superlink-host", head, "--superlink-port", "29700", "--remote-nodes",
             "--summary-json", str(run / "out.json"), "--timeout", "180",
             "--token-env", "TORSH_FEDERATED_TOKEN", *security],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        pki = run / "tls"
        if tls:  # the head writes the federation's CA and the nodes' certificates first
            deadline = time.monotonic() + 60
            while not (pki / "node-1.key").exists():
                assert server.poll() is None and time.monotonic() < deadline, "no certificates from the head"
                time.sleep(0.1)
        bad: list[subprocess.Popen[bytes]] = []
        if bad_nodes:
            from torsh_distributed.runtime.tls import issue, make_ca

            other = make_ca(run.parent / "other-ca")
            o_cert, o_key = issue(other, run.parent / "other-ca", name="intruder")
            for ca, cert, key in ((pki / "ca.pem", o_cert, o_key), (other.cert, pki / "node-0.pem", pki / "node-0.key")):
                bad.append(lab.popen(
                    3, [*CLI, "federated-node", "--superlink", f"{head}:29700", "--partition-id", "0",
                        "--num-partitions", "2", "--token-env", "TORSH_FEDERATED_TOKEN",
                        "--tls-ca", str(ca), "--tls-cert", str(cert), "--tls-key", str(key)],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                ))  # fmt: skip
        for host in (1, 2):
            pid = host - 1
            node_tls = (["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / f"node-{pid}.pem"),
                         "--tls-key", str(pki / f"node-{pid}.key")] if tls else ["--insecure"])  # fmt: skip
            lab.popen(
                host,
                [*CLI, "federated-node", "--superlink", f"{head}:29700", "--partition-id", str(pid),
                 "--num-partitions", "2", "--token-env", "TORSH_FEDERATED_TOKEN", *node_tls],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        out, _ = server.communicate(timeout=200)
        errors = []
        for proc in bad:
            proc.send_signal(signal.SIGINT)
            try:
                errors.append(proc.communicate(timeout=20)[1].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                proc.kill()
                errors.append(proc.communicate()[1].decode(errors="replace"))
    finally:
        capture.send_signal(signal.SIGTERM)
        capture.wait(timeout=20)
    text = out.decode(errors="replace")
    assert server.returncode == 0, text[-4000:]
    return json.loads((run / "out.json").read_text()), text, pcap.read_bytes(), errors


def test_clients_on_other_hosts_join_in_the_clear_and_over_tls(tmp_path: Path) -> None:
    windows = _model_windows()
    with NetLab(hosts=4, rate_mbit=0, net=51) as lab:
        plain, _, plain_wire, _ = _round(lab, tmp_path / "plain", tls=False, bad_nodes=False)
        secure, text, secure_wire, bad = _round(lab, tmp_path / "tls", tls=True, bad_nodes=True)
    head = lab.address(0)
    for summary in (plain, secure):
        (only,) = summary["rounds"]
        assert only["answered"] == 2 and [c["partition_id"] for c in only["clients"]] == [0, 1]
    assert f"SuperLink at {head}:29700" in text and "TLS with a new CA for this federation" in text

    # the capture sees the model in the clear (so it can fail), and not over TLS; never the token
    assert any(w in plain_wire for w in windows), "the plaintext capture holds none of the model's bytes"
    assert len(secure_wire) > 10_000 and not any(w in secure_wire for w in windows)
    assert TOKEN.encode() not in plain_wire and TOKEN.encode() not in secure_wire

    # a node with another CA's certificate: refused by the head; a node trusting another CA: refuses the head
    refused = [line for line in text.splitlines() if "refused a node: TLS handshake failed" in line]
    assert refused and len(refused) == len(set(refused)), text[-3000:]  # one line per kind, not per retry
    assert any("certificate" in line for line in refused), refused
    (_, misled) = bad
    assert f"cannot join {head}:29700 over TLS" in misled and "is --tls-ca the federation's CA?" in misled
    assert len([ln for ln in misled.splitlines() if "cannot join" in ln]) == 1

    # the same round: FedAvg of the 2 equal IID clients, one local step of plain SGD each, equals one
    # step of centralized SGD on the union of their batches (the whole toy set), to 1e-5; TLS changes nothing
    assert secure["rounds"][0]["train_loss"] == plain["rounds"][0]["train_loss"]
    assert secure["rounds"][0]["loss"] == plain["rounds"][0]["loss"]
    got = {}
    for name in ("plain", "tls"):
        got[name] = torch.load(tmp_path / name / "server" / "round_00001" / "model.pt", weights_only=True)
    for name, tensor in centralized_sgd_step(0.5).items():
        torch.testing.assert_close(got["tls"][name], tensor, rtol=0, atol=1e-5)
        assert torch.equal(got["tls"][name], got["plain"][name])
