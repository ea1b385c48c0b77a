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
        (["--superlink-host", "0.0.0.0"], "needs a shared token"),
        (["--superlink-host", "10.1.2.3"], "--superlink-host 10.1.2.3: this host has no such address"),
        (["--superlink-host", "no-such-host.invalid"], "not an address or a name that resolves"),
        (["--superlink-port", "70000"], "--superlink-port must be a TCP port in 0..65535"),
        (["--superlink-port", "-1"], "--superlink-port must be a TCP port in 0..65535"),
        (["--strategy", f"{TOY}:make_model"], "returned Sequential, not a Flower Strategy"),
        (["--strategy", f"{TOY}:nope"], "has no 'nope'"),
        (["--fraction-evaluate", "1.5"], "fraction_evaluate must be in [0, 1]"),
        (["--fraction-evaluate", "0.5", "--noise-multiplier", "1.0", "--delta", "1e-5"],
         "does not combine with DP"),
        (["--app", "/no/such/app"], "--app /no/such/app: no pyproject.toml"),
        (["--app-config", "num-server-rounds=3"], "--app-config applies to --app DIR"),
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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "without TLS would carry weights and updates in the clear"),
        (["--tls-ca", "ca.pem"], "give --tls-ca, --tls-cert and --tls-key together"),
        (["--tls-ca", "/no/ca.pem", "--tls-cert", "/no/n.pem", "--tls-key", "/no/n.key"], "/no/ca.pem"),
    ],
)
def test_a_node_off_loopback_needs_tls_or_insecure(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORSH_TEST_TOKEN", "a-token-of-sixteen-chars")
    argv = ["federated-node", "--superlink", "10.1.2.3:9000", "--partition-id", "0", "--num-partitions", "2",
            "--token-env", "TORSH_TEST_TOKEN", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("torsh-dist federated-node: error:") and message in err, err


def test_tls_files_on_loopback_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torsh_distributed.runtime.tls import quick_start

    server, _ = quick_start(tmp_path / "pki", hosts=["127.0.0.1"], parties=[])
    flags = ["--tls-ca", str(server.ca), "--tls-cert", str(server.cert), "--tls-key", str(server.key)]
    assert main(["federated", *flags, "--run-dir", str(tmp_path / "run")]) == 2
    assert "on loopback nothing leaves this host" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
