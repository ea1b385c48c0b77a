"""`torsh-dist train --model MODULE:FUNCTION --dataset MODULE:FUNCTION`: the user's own model
through the real launcher on 1, 2 and 4 ranks, and every bad input reported before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torsh_distributed.cli.main import main
from torsh_distributed.testing.cli import run_cli

MODELS = "torsh_distributed.testing.models"
USER = ["--model", f"{MODELS}:tiny_lm", "--dataset", f"{MODELS}:token_data",
        "--val-dataset", f"{MODELS}:token_data"]
QUICK = ["--max-steps", "4", "--batch-size", "16", "--eval-batches", "1", "--progress", "false"]

FACTORIES = '''
import torch
from torsh_distributed.testing.models import PairDataset, mlp

def make_model():
    return mlp()

def make_dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return PairDataset(x, (x.sum(dim=1) > 0).long())

def not_a_model():
    return 42

def not_pairs():
    return [torch.zeros(3)] * 8

def broken():
    raise RuntimeError("no data today")
'''


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_cli(["train", *args], timeout=timeout)  # a warm process (torsh_distributed.testing.cli)


def _refused(args: list[str], capfd: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """``torsh-dist train ARGS`` run in this process: exit code, stdout, stderr (file-descriptor
    level, so a rank that started would show). For inputs refused before any rank starts: the
    same code as the command, without ~3 s of interpreter start per case."""
    monkeypatch.setattr(sys, "path", [*sys.path])  # a MODULE:FUNCTION spec adds the cwd
    try:
        code = main(["train", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capfd.readouterr()
    return code, out, err


def _summary(tmp_path: Path, name: str, args: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    proc = _run([*args, "--summary-json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture()
def factories(tmp_path: Path) -> str:
    path = tmp_path / "my_factories.py"
    path.write_text(FACTORIES)
    return str(path)


def test_one_and_two_ranks_train_the_same_user_model(tmp_path: Path):
    one = _summary(tmp_path, "one", [*USER, *QUICK])
    two = _summary(tmp_path, "two", ["--nproc-per-node", "2", *USER, *QUICK, "--zero-stage", "3"])
    assert one["world_size"] == 1 and two["world_size"] == 2 and two["steps"] == 4
    for key in ("initial_loss", "final_loss", "val_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    assert one["samples_per_s"] > 0


@pytest.mark.slow
def test_four_ranks_pipeline_split_of_a_file_factory(tmp_path: Path, factories: str):
    s = _summary(tmp_path, "pp", ["--nproc-per-node", "4", "--model", f"{factories}:make_model",
                                  "--dataset", f"{factories}:make_dataset", *QUICK,
                                  "--pp", "2", "--pp-split", "2", "--microbatches", "2"])
    assert s["world_size"] == 4 and s["layout"] == {"dp": 2, "tp": 1, "pp": 2, "ep": 1}


BAD = [
    (["--model", "no_such_pkg.nets:make", "--dataset", f"{MODELS}:token_data"],
     "--model no_such_pkg.nets:make: cannot import 'no_such_pkg.nets'"),
    (["--model", f"{MODELS}:nothing_here", "--dataset", f"{MODELS}:token_data"],
     f"module '{MODELS}' has no 'nothing_here'"),
    (["--model", "tiny_lm", "--dataset", f"{MODELS}:token_data"],
     "--model must be MODULE:FUNCTION"),
    (["--dataset", f"{MODELS}:token_data"], "--dataset need --model"),
    (["--model", f"{MODELS}:tiny_lm"], "--model needs --dataset"),
    ([*USER, "--pp", "2", "--pp-split", "layer.9"], "'layer.9' names no module"),
    ([*USER, "--tp", "2"], "--tp 2 needs --tp-plan"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_is_one_clear_line_before_any_rank(
    args: list[str], message: str, capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
):
    code, out, err = _refused(["--nproc-per-node", "2", *args, *QUICK], capfd, monkeypatch)
    assert code == 2, out[-2000:] + err[-2000:]
    assert message in err, err
    assert "Traceback" not in err and "[rank" not in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "{f}:not_a_model", "--dataset", "{f}:make_dataset"],
         "returned int, expected a torch.nn.Module"),
        (["--model", "{f}:make_model", "--dataset", "{f}:not_pairs"],
         "items must be (input, target) pairs"),
        (["--model", "{f}:make_model", "--dataset", "{f}:broken"], "no data today"),
        (["--model", "{f}/missing.py:make_model", "--dataset", "{f}:make_dataset"],
         "cannot import"),
    ],
)
def test_bad_factories_in_a_file(
    factories: str, flags: list[str], message: str, capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
):
    args = ["--nproc-per-node", "2", *[f.format(f=factories) for f in flags], *QUICK]
    code, out, err = _refused(args, capfd, monkeypatch)
    assert code == 2, out[-2000:] + err[-2000:]
    assert message in err, err
    assert "[rank" not in out


ORDINARY = ["--dataset", f"{MODELS}:classification_data", "--val-dataset",
            f"{MODELS}:classification_data"]
PP2 = ["--nproc-per-node", "2", "--pp", "2", "--pp-split", "layers.2", "--microbatches", "2"]


def test_pipeline_of_an_ordinary_forward_is_traced_and_trains_like_one_process(tmp_path: Path):
    # PlainNet's forward calls every module (no None checks): the split is made by tracing
    user = ["--model", f"{MODELS}:plain_net", *ORDINARY, *QUICK]
    one = _summary(tmp_path, "one", user)
    two = _summary(tmp_path, "pp", [*PP2, *user])
    assert two["layout"] == {"dp": 1, "tp": 1, "pp": 2, "ep": 1} and two["steps"] == 4
    for key in ("initial_loss", "final_loss", "val_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key


def test_pipeline_of_an_untraceable_ordinary_forward_is_one_line_on_every_rank():
    # GatedNet branches on a tensor's value and calls `out` on stage 0: refused before step 1
    # (that every rank raises it is tested in tests/distributed/test_pipeline_trace.py; here the
    # launcher stops the peer once the first rank has failed)
    proc = _run(["--model", f"{MODELS}:gated_net", *ORDINARY, *QUICK, *PP2], timeout=120)
    line = ("ValueError: GatedNet: stage 0 of 2 called `out`, which lives on stage 1, and tracing "
            "the forward with torch.export to split it failed (GuardOnDataDependentSymNode: ")
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "GatedNet: stage 0 of 2 called `out`" in ln]
    assert errors and errors[0].startswith(line), proc.stderr[-3000:]
    assert "models.py:" in errors[0] and "skip the modules that are None" in errors[0]
    assert "Connection closed" not in proc.stderr and "NoneType" not in proc.stderr
    assert "after step 1" not in proc.stdout, proc.stdout
