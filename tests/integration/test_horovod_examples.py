"""The Horovod example scripts (examples/horovod/, only the import line differs from Horovod's
style) through the real ``torsh-dist horovodrun -np 2``: real worker processes, Gloo on CPU.

The elastic one is killed: rank 1 SIGKILLs itself in epoch 1 (first attempt only, a flag file
says it happened); the launcher restarts both workers, training resumes at the last commit and
ends with the weights of a run that was never interrupted.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from torsh_distributed.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def horovodrun(*argv: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    env.pop("TORSH_HOROVOD_ELASTIC_DIR", None)
    result = run_cli(["horovodrun", *argv], cwd=REPO, env=env, timeout=TIMEOUT_S)  # a warm process
    assert result.returncode == expect, (
        f"torsh-dist horovodrun {' '.join(argv)} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
    )
    return result


def rank0(stdout: str, pattern: str) -> list[tuple[str, ...]]:
    return [m.groups() for m in re.finditer(rf"^\[rank0\]: {pattern}$", stdout, re.MULTILINE)]


def test_mnist_example_trains_on_two_ranks() -> None:
    out = horovodrun("-np", "2", "-H", "localhost:2", "python",
                     "examples/horovod/pytorch_mnist.py", "--epochs", "2").stdout
    losses = [float(v) for (v,) in rank0(out, r"Train Epoch: \d+\tAverage loss: (\d+\.\d+)")]
    accuracy = rank0(out, r"Test set: Average loss: (\d+\.\d+), Accuracy: (\d+\.\d+)%")
    assert len(losses) == 2 and len(accuracy) == 2, out[-3000:]
    assert losses[1] < losses[0] * 0.8, losses
    assert float(accuracy[-1][1]) >= 90.0, accuracy


def test_accumulation_with_fp16_compression_example() -> None:
    result = horovodrun("-np", "2", "--fusion-threshold-mb", "32", "python", "-u",
                        "examples/horovod/pytorch_mnist_accumulate.py",
                        "--batches-per-allreduce", "2", "--fp16-allreduce")
    out = result.stdout
    epochs = rank0(out, r"epoch (\d+): train loss (\d+\.\d+), train accuracy (\d+\.\d+)%")
    assert len(epochs) == 2, out[-3000:]
    assert float(epochs[1][1]) < float(epochs[0][1]) * 0.5, epochs
    assert float(epochs[1][2]) >= 80.0, epochs
    assert rank0(out, r"final weights identical on all ranks: True \(checksum -?\d+\.\d+\)"), out[-2000:]
    assert "--fusion-threshold-mb has no effect here" in result.stderr


def test_elastic_example_rolls_back_to_the_last_commit_after_a_killed_rank(tmp_path: Path) -> None:
    script = "examples/horovod/pytorch_mnist_elastic.py"
    flag = tmp_path / "killed"
    killed = horovodrun("-np", "2", "--reset-limit", "2", "python", script,
                        "--kill-once", str(flag), "--kill-at-epoch", "1", "--kill-at-batch", "5",
                        "--batches-per-commit", "4").stdout
    assert flag.exists()
    assert "[rank1]: killing rank 1 at epoch 1 batch 5" in killed
    # first attempt from the start; after the restart, from the commit at batch 4 of epoch 1
    assert rank0(killed, r"training starts at epoch (\d+) batch (\d+)") == [("0", "0"), ("1", "4")]
    assert rank0(killed, r"reset: lr = (\S+)") == [("0.1",)]  # the reset callback ran once
    final = rank0(killed, r"finished (\d+) epochs; weights checksum (-?\d+\.\d+)")
    assert len(final) == 1 and final[0][0] == "2", killed[-3000:]

    clean = horovodrun("-np", "2", "python", script, "--batches-per-commit", "4").stdout
    assert rank0(clean, r"training starts at epoch (\d+) batch (\d+)") == [("0", "0")]
    assert rank0(clean, r"finished (\d+) epochs; weights checksum (-?\d+\.\d+)") == final
