"""`torsh-dist serve --tls-cert/--tls-key`: HTTPS on loopback with a throwaway CA made in the test,
answered to the official `openai` client given the CA and to no client without it; the refusal
of a token over plain HTTP off loopback unless `--insecure`. Serves the session's tiny checkpoint
(conftest) through the helpers of test_serve.py."""

from __future__ import annotations

import signal
import ssl
from pathlib import Path

import httpx
import openai
import pytest
from test_serve import TOKEN, Served

from torsh_distributed.inference import SamplingConfig, generate
from torsh_distributed.inference.load import load_gpt
from torsh_distributed.inference.server import ServerConfig
from torsh_distributed.inference.text import decode_bytes, encode_bytes
from torsh_distributed.runtime.tls import issue, make_ca
from torsh_distributed.testing import find_free_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca")
    cert, key = issue(ca, root / "server", name="server", hosts=["127.0.0.1", "localhost"])
    other = make_ca(root / "other", name="some other CA")
    return {"ca": ca.cert, "cert": cert, "key": key, "other_ca": other.cert}


def tls_client(url: str, ca: Path | None) -> openai.OpenAI:
    """The official client trusting ``ca`` only (``None``: the system's public CAs)."""
    verify = ssl.create_default_context(cafile=str(ca)) if ca else True
    return openai.OpenAI(
        base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=30,
        http_client=openai.DefaultHttpxClient(verify=verify),
    )  # fmt: skip


def test_cli_serves_https_to_the_openai_client_given_the_ca_and_to_no_other(
    serve_checkpoint: str, pki: dict[str, Path], tmp_path: Path
):
    served = Served(
        ["--checkpoint", serve_checkpoint, "--token-env", "TORSH_TEST_SERVE_TOKEN",
         "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])],
        tmp_path / "serve-tls.log",
        env={"TORSH_TEST_SERVE_TOKEN": TOKEN},
    )  # fmt: skip
    https = served.url.replace("http://", "https://")
    try:
        served.wait_ready()
        assert f"listening on {https} " in served.output() and "TLS)" in served.output()
        oc = tls_client(https, pki["ca"])
        assert [m.id for m in oc.models.list().data] == ["ckpt"]
        answer = oc.completions.create(model="ckpt", prompt="def main():\n", max_tokens=12, temperature=0)
        model = load_gpt(serve_checkpoint)[0]
        expected = generate(model, encode_bytes("def main():\n"), SamplingConfig(max_new_tokens=12, temperature=0),
                            decode=decode_bytes)  # fmt: skip
        assert answer.choices[0].text == expected.text
        # a client that trusts another CA, or only the public ones, refuses the certificate
        for ca in (pki["other_ca"], None):
            with pytest.raises(openai.APIConnectionError) as info:
                tls_client(https, ca).models.list()
            assert "CERTIFICATE_VERIFY_FAILED" in repr(info.value.__cause__), info.value.__cause__
        # plain HTTP gets no answer: the server only speaks TLS
        with pytest.raises(httpx.HTTPError):
            httpx.get(served.url + "/health", timeout=10)
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(30) == 0, served.output()
    finally:
        served.close()


def test_a_token_over_plain_http_off_loopback_needs_insecure(
    serve_checkpoint: str, pki: dict[str, Path], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
):  # fmt: skip
    from torsh_distributed.cli.main import main

    monkeypatch.setenv("TORSH_TEST_SERVE_TOKEN", TOKEN)
    base = ["serve", "--checkpoint", serve_checkpoint, "--port", str(find_free_port()),
            "--token-env", "TORSH_TEST_SERVE_TOKEN"]  # fmt: skip
    assert main([*base, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "torsh-dist serve: error: server.host '0.0.0.0' is not a loopback address and the server "
        "has no TLS: the token and every prompt would cross the network in clear text; give "
        "--tls-cert FILE --tls-key FILE, or --insecure to serve plain HTTP anyway (behind a "
        "TLS-terminating proxy or on a trusted network)"
    ]
    assert main([*base, "--tls-cert", str(pki["cert"])]) == 2
    assert "server.tls_cert and server.tls_key go together" in capsys.readouterr().err
    assert main([*base, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["ca"])]) == 2
    assert "not a PEM certificate and its matching private key" in capsys.readouterr().err
    # said in as many words, the config is accepted (nothing is bound here)
    ServerConfig(host="0.0.0.0", token=TOKEN, insecure=True)
    ServerConfig(host="0.0.0.0", token=TOKEN, tls_cert=str(pki["cert"]), tls_key=str(pki["key"]))
    with pytest.warns(UserWarning, match="server.insecure is ignored: the server speaks TLS"):
        ServerConfig(tls_cert=str(pki["cert"]), tls_key=str(pki["key"]), insecure=True)
