"""``--config FILE.toml`` and ``--print-config`` (train, federated, serve): the file is the
command's flags, flags override it, and the printed config fed back is the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torsh_distributed.cli.main import main

pytestmark = pytest.mark.timeout(120)


def _print(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main([*argv, "--print-config"]) == 0
    return capsys.readouterr().out


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", [
    ["train", "--preset", "tiny", "--max-steps", "7", "--optim.lr", "0.002", "--nproc-per-node", "2"],
    ["train", "--model", "examples/factories.py:make_model", "--dataset", "examples/factories.py:make_dataset",
     "--zero-stage", "2", "--nproc-per-node", "2"],
    ["federated", "--rounds", "2", "--clients", "2", "--client.lr", "0.1"],
    ["serve", "--checkpoint", "runs/x", "--port", "8011"],
])
def test_printed_config_fed_back_prints_the_same(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _print(command, capsys)
    file = tmp_path / "run.toml"
    file.write_text(first)
    assert _print([command[0], "--config", str(file)], capsys) == first


def test_train_resolves_every_field_and_flags_override_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "run.toml"
    file.write_text('preset = "tiny"\nmax-steps = 7\n[optim]\nlr = 0.002\n')
    text = _print(["train", "--config", str(file), "--max-steps", "9"], capsys)
    assert "max_steps = 9\n" in text  # the flag wins over the file
    assert "lr = 0.002\n" in text.split("[optim]")[1]
    assert "[model]" in text and "[parallel]" in text  # every section, preset values included


def test_user_model_sits_in_a_user_table_without_the_built_in_gpt_sections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _print(["train", "--model", "examples/factories.py:make_model",
                   "--dataset", "examples/factories.py:make_dataset"], capsys)
    assert '[user]\nmodel = "examples/factories.py:make_model"\ndataset = ' in text
    assert "[model]" not in text and "[data]" not in text


def test_the_file_satisfies_a_required_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "serve.toml"
    file.write_text('checkpoint = "runs/demo"\nport = 8011\n')
    assert 'checkpoint = "runs/demo"' in _print(["serve", "--config", str(file)], capsys)


@pytest.mark.parametrize(("content", "message"), [
    ("max_step = 3\n", "unknown key 'max_step' (did you mean max_steps"),
    ('[optim]\nlr = "fast"\n', "optim.lr: --optim.lr expects float, got 'fast'"),
    ("max_steps = 1.5\n", "max_steps: --max-steps expects int, got 1.5"),
    ('preset = "huge"\n', "--preset must be one of demo, small, tiny, got 'huge'"),
    ("progress = [1]\n", "--progress takes one value"),
    ("max_steps = \n", "not valid TOML"),
    ("[optim.inner]\nlr = 1\n", "tables nest one level only"),
    ("[user]\nmodle = 'x:y'\n", "unknown key 'user.modle' (did you mean user.model"),
])
def test_bad_files_are_refused_naming_the_file_and_the_key(
    content: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "bad.toml"
    file.write_text(content)
    err = _error(["train", "--config", str(file)], capsys)
    assert f"--config {file}" in err and message in err, err


def test_missing_and_non_utf8_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no such file" in _error(["train", "--config", str(tmp_path / "none.toml")], capsys)
    file = tmp_path / "latin1.toml"
    file.write_bytes('summary_json = "r\xe9sum\xe9.json"\n'.encode("latin-1"))
    err = _error(["train", "--config", str(file)], capsys)
    assert f"--config {file}" in err and ("not UTF-8" in err or "not valid TOML" in err), err


def test_a_config_flag_of_a_users_script_is_left_to_the_script() -> None:
    from torsh_distributed.cli._config_file import apply_config_file
    from torsh_distributed.cli.main import build_parser

    parser = build_parser("run")
    apply_config_file(parser, ["run", "script.py", "--config", "/no/such.yaml"], "run")  # no error
    args = parser.parse_args(["run", "script.py", "--config", "/no/such.yaml"])
    assert args.script_args == ["--config", "/no/such.yaml"]


def _summary(path: Path) -> dict[str, float]:
    data = json.loads(path.read_text())
    return {k: data[k] for k in ("steps", "initial_loss", "final_loss", "val_loss", "num_params", "layout")}


def test_the_printed_config_runs_the_same_training(tmp_path: Path) -> None:
    """One process, 4 steps: the flags' run and the printed file's run give equal summaries."""
    cli = [sys.executable, "-m", "torsh_distributed.cli.main", "train"]
    flags = ["--preset", "tiny", "--max-steps", "4", "--batch-size", "8", "--seed", "6",
             "--optim.lr", "0.003", "--progress", "false"]
    env_run = {"timeout": 100, "check": True, "capture_output": True, "text": True}
    first = subprocess.run([*cli, *flags, "--summary-json", str(tmp_path / "a.json")], **env_run)
    printed = subprocess.run([*cli, *flags, "--print-config"], **env_run).stdout
    (tmp_path / "run.toml").write_text(printed)
    second = subprocess.run([*cli, "--config", str(tmp_path / "run.toml"),
                             "--summary-json", str(tmp_path / "b.json")], **env_run)
    assert first.returncode == second.returncode == 0
    assert _summary(tmp_path / "a.json") == _summary(tmp_path / "b.json")
