"""``torsh-dist federated``'s bad input: one line naming what is wrong, exit 2, before any process
starts (no run directory is created)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh_distributed.cli.main import main

TOY = Path(__file__).parents[1] / "integration" / "_federated_toy.py"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "fedmagic"], "unknown strategy 'fedmagic'; choose one of fedavg, fedprox"),
        (["--partition", "dirichlet", "--alpha", "0", "--model", f"{TOY}:make_model", "--dataset", f"{TOY}:dataset"],
         "alpha (Dirichlet concentration) must be > 0"),
        (["--clients", "2", "--min-clients", "3"], "min_clients (3) is more than the 2 clients"),
        (["--noise-multiplier", "1.0"], "DP without a delta"),
        (["--compression", "ternary"], "cannot encode a single client's update"),
        (["--clients", "20", "--model", f"{TOY}:make_model", "--dataset", f"{TOY}:dataset", "--batch-size", "8"],
         "samples, fewer than one batch"),
        (["--superlink-host", "10.1.2.3"], "needs a shared token"),
        (["--model", f"{TOY}:nope", "--dataset", f"{TOY}:dataset"], "has no 'nope'"),
    ],
)
def test_bad_input_is_one_line_before_anything_starts(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(["federated", *flags, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("torsh-dist federated: error:") and message in err, err
    assert len(err.splitlines()) == 1
    assert not run_dir.exists()


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["federated", "--help"])
    text = capsys.readouterr().out
    for flag in ("--clients", "--strategy", "--partition", "--alpha", "--stragglers", "--round-timeout",
                 "--client-nproc", "--noise-multiplier", "--delta", "--compression", "--regions",
                 "--metrics-port", "--token-env", "--remote-nodes"):  # fmt: skip
        assert flag in text
    assert "--initial-state" not in text and "--round-offset" not in text  # internal fields
