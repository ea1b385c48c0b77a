"""Every script in ``examples/`` runs end to end through the real launcher (``torsh-dist run`` or
``torsh-dist train``): real worker processes, Gloo on CPU, 6 steps each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torsh_distributed.testing import find_free_port
from torsh_distributed.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 180
# Variables of an enclosing launcher would leak into the one under test.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_FLOAT = r"(\d+\.\d+)"

# script -> a line every rank prints at the end (groups: values that must agree across ranks)
FINAL_LINES = {
    "ddp_compression.py": rf"final loss {_FLOAT}, validation {_FLOAT}, compression ratio {_FLOAT}x",
    "zero3.py": rf"final loss {_FLOAT}; model states per rank (\d+) B",
    "tp_plan.py": rf"final loss {_FLOAT} with tp=2",
    "pipeline_split.py": rf"final loss {_FLOAT}, layout (\{{'dp': 1, 'tp': 1, 'pp': 2, 'ep': 1\}})",
}
COVERED = {*FINAL_LINES, "own_loop.py", "factories.py", "ray_dask.py", "federated_digits.py",
           "hf_llama.py"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    return env


def torsh_dist(*argv: str) -> str:
    """Run ``torsh-dist ARGV`` from the repository root; its stdout, after checking it exited 0."""
    result = run_cli(argv, cwd=REPO, env=_env(), timeout=TIMEOUT_S)  # a warm process
    assert result.returncode == 0, (
        f"torsh-dist {' '.join(argv)} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
    )
    return result.stdout


def run_example(script: str, *args: str, nproc: int = 2, max_steps: int = 6) -> str:
    return torsh_dist(
        "run", "--nproc-per-node", str(nproc), f"examples/{script}",
        "--max-steps", str(max_steps), *args,
    )


def final_values(stdout: str, pattern: str, *, nproc: int) -> tuple[str, ...]:
    """The groups of ``pattern`` in each rank's final line; every rank must print the same."""
    found = {
        int(m.group(1)): m.groups()[1:]
        for m in re.finditer(rf"^\[rank(\d+)\]: {pattern}$", stdout, re.MULTILINE)
    }
    assert sorted(found) == list(range(nproc)), f"final line {pattern!r} missing:\n{stdout[-4000:]}"
    assert len(set(found.values())) == 1, f"ranks disagree: {found}"
    return found[0]


def test_every_example_is_run_by_a_test() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == COVERED


def test_federated_digits_factories_train_a_client() -> None:
    """examples/federated_digits.py: a Dirichlet split of its training set (labels read from its
    ``targets``) and one client's round with the engine raise the server's held-out accuracy."""
    from torsh_distributed.federated.client import train_round
    from torsh_distributed.federated.config import ClientConfig, FederatedConfig, TaskConfig
    from torsh_distributed.federated.task import Task, evaluate

    digits = EXAMPLES / "federated_digits.py"
    task = TaskConfig(model=f"{digits}:make_model", dataset=f"{digits}:train_set",
                      val_dataset=f"{digits}:test_set")  # fmt: skip
    config = FederatedConfig(clients=4, partition="dirichlet", alpha=0.5, task=task,
                             client=ClientConfig(local_steps=40, batch_size=16, lr=0.1))  # fmt: skip
    built = Task(config)
    model = built.model()
    before = evaluate(model, built.val_dataset(), built.loss(), seed=0)
    result = train_round(config, model.state_dict(), partition_id=0, server_round=1)
    model.load_state_dict(result.state)
    after = evaluate(model, built.val_dataset(), built.loss(), seed=0)
    assert result.num_examples == len(built.client_data(0).dataset) < 1497
    assert after["accuracy"] > before["accuracy"] + 0.1 and after["loss"] < before["loss"]


@pytest.mark.parametrize("script", sorted(FINAL_LINES))
def test_example_runs_on_two_ranks(script: str) -> None:
    values = final_values(run_example(script), FINAL_LINES[script], nproc=2)
    assert float(values[0]) > 0  # a loss was computed (NaN would not match the pattern)


@pytest.mark.slow
def test_pipeline_split_dp2_pp2_on_four_ranks() -> None:
    stdout = run_example("pipeline_split.py", "--split", "layers.1", nproc=4)
    pattern = rf"final loss {_FLOAT}, layout (\{{'dp': 2, 'tp': 1, 'pp': 2, 'ep': 1\}})"
    final_values(stdout, pattern, nproc=4)


OWN_LOOP_FINAL = rf"steps (\d+) -> (\d+): final loss {_FLOAT}, accuracy {_FLOAT}, compression {_FLOAT}x"


def _own_loop_final(stdout: str) -> tuple[str, ...]:
    match = re.search(rf"^\[rank0\]: {OWN_LOOP_FINAL}$", stdout, re.MULTILINE)
    assert match, f"no final line:\n{stdout[-4000:]}"
    return match.groups()


@pytest.mark.timeout(3 * TIMEOUT_S + 60)
def test_own_loop_resumes_where_it_stopped(tmp_path: Path) -> None:
    ckpt, port = tmp_path / "own", find_free_port()
    first = run_example("own_loop.py", "--checkpoint-dir", str(ckpt), "--metrics-port", str(port))
    assert f"[rank0]: prometheus metrics: http://127.0.0.1:{port}/metrics" in first
    start, stop, _, _, ratio = _own_loop_final(first)
    assert (start, stop) == ("0", "6")
    assert float(ratio) > 1  # PowerSGD compressed the all-reduce
    assert (ckpt / "step_00000006").is_dir()

    second = run_example("own_loop.py", "--checkpoint-dir", str(ckpt), max_steps=12)
    assert f"[rank0]: resumed from {ckpt / 'step_00000006'} at step 6" in second
    start, stop, loss, accuracy, _ = _own_loop_final(second)
    assert (start, stop) == ("6", "12")
    assert (ckpt / "step_00000012").is_dir()

    # Model, optimizer, data position, RNG and PowerSGD state all resumed: same as no break.
    whole = run_example("own_loop.py", "--checkpoint-dir", str(tmp_path / "whole"), max_steps=12)
    assert _own_loop_final(whole)[:4] == ("0", "12", loss, accuracy)


def test_factories_through_torsh_dist_train() -> None:
    stdout = torsh_dist(
        "train", "--nproc-per-node", "2",
        "--model", "examples/factories.py:make_model",
        "--dataset", "examples/factories.py:make_dataset",
        "--val-dataset", "examples/factories.py:make_val",
        "--max-steps", "6", "--batch-size", "16",
    )
    assert re.search(r"^\[rank0\]: \| steps\s+\|\s+6 \|$", stdout, re.MULTILINE), stdout[-4000:]
    assert re.search(rf"^\[rank0\]: \| validation loss\s+\|\s+{_FLOAT} \|$", stdout, re.MULTILINE)


def test_hf_llama_example_exports_what_transformers_loads(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed: pip install '.[hf]'")
    stdout = run_example("hf_llama.py", "--workdir", str(tmp_path / "hf"))
    pattern = (rf"final loss {_FLOAT}; FSDP units model\.layers\.\*; transformers logits "
               r"equal ours: (yes)")
    assert float(final_values(stdout, pattern, nproc=2)[0]) > 0


@pytest.mark.timeout(150)
def test_ray_dask_example_trains_on_a_local_dask_cluster(tmp_path: Path) -> None:
    # the Dask half (a LocalCluster of 2 worker processes); tests/integration/test_launch_ray.py
    # and test_launch_dask.py cover both launchers' failures and resumes
    pytest.importorskip("distributed", reason="Dask is not installed: pip install '.[dask]'")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "ray_dask.py"), "--backend", "dask", "--max-steps", "12",
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        # a hang guard, not a speed bound: 48 s alone beside a running suite; a LocalCluster's
        # start-up on a busy 2-core host takes much longer (pytest's own limit is 300 s)
        cwd=tmp_path, env=_env(), timeout=270, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["backend"], summary["world_size"], summary["steps"]) == ("dask", 2, 12)
    assert summary["final_loss"] < summary["initial_loss"]
    assert (tmp_path / "ckpt" / "step_00000010").is_dir()
