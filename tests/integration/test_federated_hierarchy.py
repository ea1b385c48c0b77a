"""Two-level aggregation for real: 4 clients in 2 regions, each region its own SuperLink whose
aggregator answers the server's SuperLink. FedAvg at both levels with one SGD step equals one
step of centralized SGD on the union of the clients' batches (1e-5): the hierarchy changes who
averages, not the average."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
from torsh_distributed.federated.deploy import Federation

TOY = Path(__file__).with_name("_federated_toy.py")
sys.path.insert(0, str(TOY.parent))

from _federated_toy import centralized_sgd_step  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_regions_average_like_one_server(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = FederatedConfig(
        clients=4, regions=2, rounds=1, min_clients=2, partition="iid", run_dir=str(run),
        task=TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset"),
        client=ClientConfig(local_steps=1, batch_size=8, lr=0.5),
    )  # fmt: skip
    lines: list[str] = []
    fed = Federation(config, echo=lines.append)
    with fed.running():
        assert fed.submit(timeout=280) == 0, lines
    summary = json.loads((run / "summary.json").read_text())
    (record,) = summary["rounds"]
    assert record["answered"] == 2 and all(c["region"] for c in record["clients"])
    assert [c["examples"] for c in record["clients"]] == [16, 16]  # each region: 2 clients x 8
    for region in (0, 1):  # each region ran its own round over its own two clients
        sub = json.loads((run / "regions" / f"region{region}" / "round_00001" / "summary.json").read_text())
        assert sorted(c["partition_id"] for c in sub["rounds"][0]["clients"]) == [2 * region, 2 * region + 1]

    got = torch.load(run / "server" / "round_00001" / "model.pt", weights_only=True)
    for name, tensor in centralized_sgd_step(0.5).items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)


def test_regions_are_contiguous_blocks_and_checked() -> None:
    config = FederatedConfig(clients=5, regions=2, partition="iid",
                             task=TaskConfig(model=f"{TOY}:make_model", dataset=f"{TOY}:dataset"))  # fmt: skip
    assert [config.region_members(r) for r in (0, 1)] == [[0, 1, 2], [3, 4]]
    assert config.expected_nodes == 2
    with pytest.raises(ValueError, match="regions must be in"):
        FederatedConfig(clients=2, regions=3)
    with pytest.raises(ValueError, match="min_clients \\(3\\) must be <= regions"):
        FederatedConfig(clients=6, regions=2, min_clients=3)
