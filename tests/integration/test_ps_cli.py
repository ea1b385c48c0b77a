"""`torsh-dist train --ps-servers S --staleness s` trains the built-in GPT asynchronously through
the real launcher: 1 server + 2 workers, the staleness bound held, the summary written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torsh_distributed.testing.cli import run_cli

CLI = ["train"]  # run_cli's arguments: torsh-dist train in a warm process


def test_the_built_in_model_trains_with_bounded_staleness(tmp_path: Path):
    out = tmp_path / "ps.json"
    proc = run_cli(
        [*CLI, "--nproc-per-node", "3", "--ps-servers", "1", "--staleness", "2", "--preset", "tiny",
         "--max-steps", "6", "--progress", "false", "--summary-json", str(out)],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert (summary["num_servers"], summary["num_workers"], summary["steps"]) == (1, 2, 6)
    assert summary["staleness_bound"] == 2 and summary["max_staleness"] <= 2
    assert sum(summary["staleness_histogram"].values()) > 0
    for losses in summary["worker_losses"]:  # both workers learn
        assert losses[-1] < losses[0]


def test_synchronous_ps_trains_like_data_parallelism_from_the_same_command(tmp_path: Path):
    # issue 39's command: the server's Adam once ignored the schedule, the decay and AdamW
    # (final loss 3.4994 with --ps-servers against 4.6719 without)
    same = ["--nproc-per-node", "2", "--preset", "tiny", "--max-steps", "12", "--seed", "6", "--batch-size", "16",
            "--eval-batches", "1", "--progress", "false"]
    out = {}
    for name, extra in (("dp", []), ("ps", ["--ps-servers", "1", "--staleness", "0"])):
        path = tmp_path / f"{name}.json"
        proc = run_cli([*CLI, *same, *extra, "--summary-json", str(path)], timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out[name] = json.loads(path.read_text())
    assert out["ps"]["mode"] == "sync" and out["ps"]["num_workers"] == 1
    assert out["ps"]["final_loss"] == pytest.approx(out["dp"]["final_loss"], abs=1e-4)


def test_servers_need_workers(capfd: pytest.CaptureFixture[str]):
    # refused before anything starts: the command's own code in this process
    from torsh_distributed.cli.main import main

    assert main(["train", "--nproc-per-node", "1", "--ps-servers", "1", "--preset", "tiny"]) == 2
    assert "--ps-servers 1 needs --nproc-per-node > 1" in capfd.readouterr().err
    # synchronous clipping of the mean through 2 servers: no server holds its global norm
    assert main(["train", "--nproc-per-node", "4", "--ps-servers", "2", "--preset", "tiny"]) == 2
    assert "cannot clip the step's mean gradient by its global norm" in capfd.readouterr().err


def test_a_one_bit_optimizer_is_refused_and_other_optimizers_are_named_as_ignored(capfd: pytest.CaptureFixture[str]):
    from torsh_distributed.cli.main import main

    assert main(["train", "--nproc-per-node", "3", "--ps-servers", "1", "--preset", "tiny",
                 "--optimizer", "onebit_adam"]) == 2
    assert "--optimizer onebit_adam exchanges data-parallel gradients itself: not with --ps-servers" in capfd.readouterr().err
    from torsh_distributed.cli.ps_train import ps_train_config
    from torsh_distributed.train.config import preset

    config = preset("tiny")
    config.optim.optimizer = "sgd"
    with pytest.warns(UserWarning, match=r"--ps-optim adam: the servers apply adam, not the run's --optimizer sgd"):
        ps_train_config(config, {"kind": "adam", "num_servers": 1}, warn=True)
