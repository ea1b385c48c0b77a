"""`torsh-dist serve` and `InferenceServer`: real HTTP on loopback against a checkpoint trained
once per module by `torsh-dist train`.

In-process servers (a thread, port 0) cover batching, the load test, bad requests, streaming,
tokens and failure isolation; the CLI is started as a subprocess for startup refusal, a
single-process run with a token file and SIGTERM, and a `--tp 2` run through the launcher.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch import nn

from torsh_distributed.inference import SamplingConfig, TextGenerator, generate
from torsh_distributed.inference.load import load_gpt
from torsh_distributed.inference.server import InferenceServer, ServerConfig
from torsh_distributed.inference.text import decode_bytes, encode_bytes
from torsh_distributed.testing import find_free_port

CLI = [sys.executable, "-m", "torsh_distributed.cli.main"]
TOKEN = "test-token-0123456789abcdef"
PROMPTS = [
    "def main():\n",
    "import os\n",
    "class A:\n    def __init__(self):",
    "#",
    "for i in range(",
    "return x",
    "    if not self.",
    "print('hello')",
    "from typing import",
    "x = [",
    "while True:",
    "try:\n    pass\nexcept",
    "@property\ndef name(self",
    "assert ",
    "with open(path) as f:",
    "yield",
]


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("serve") / "ckpt"
    proc = subprocess.run(
        [
            *CLI,
            "train",
            "--preset",
            "tiny",
            "--max-steps",
            "20",
            "--checkpoint-dir",
            str(root),
            "--progress",
            "false",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return str(root)


@pytest.fixture(scope="module")
def model(checkpoint: str) -> nn.Module:
    return load_gpt(checkpoint)[0]


@pytest.fixture()
def server(model: nn.Module) -> Iterator[InferenceServer]:
    config = ServerConfig(
        port=0, max_batch_size=8, batch_wait_ms=30, max_new_tokens_limit=32, max_body_bytes=4096
    )
    with InferenceServer(TextGenerator(model), config, model_info={"name": "tiny"}) as srv:
        yield srv


# -- a small client ------------------------------------------------------------------------


def request(
    url: str,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> tuple[int, Any, dict[str, str]]:
    """(status, parsed JSON or text, headers)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read().decode()
        kind = resp.getheader("Content-Type", "")
        return (
            resp.status,
            json.loads(raw) if kind.startswith("application/json") else raw,
            dict(resp.getheaders()),
        )
    finally:
        conn.close()


def complete(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, data, _ = request(url, "POST", "/v1/completions", body, headers)
    return status, data


def stream(url: str, body: dict) -> list[tuple[str, dict]]:
    """The server-sent events of a streaming completion, as (event, data) pairs."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type", "").startswith(
            "text/event-stream"
        )
        events, name = [], None
        for line in resp.read().decode().splitlines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
        return events
    finally:
        conn.close()


def sampling_of(body: dict) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=body.get("max_new_tokens", 64),
        temperature=body.get("temperature", 1.0),
        top_k=body.get("top_k", 0),
        top_p=body.get("top_p", 1.0),
        seed=body.get("seed", 0),
        stop_strings=tuple(body.get("stop", ())),
    )


def reference(model: nn.Module, body: dict) -> tuple[list[int], str]:
    """The tokens and text `generate` gives for one request alone, in this process."""
    r = generate(model, encode_bytes(body["prompt"]), sampling_of(body), decode=decode_bytes)
    assert r.text is not None
    return r.tokens, r.text


def good_requests() -> list[dict]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        body: dict[str, Any] = {"prompt": prompt, "max_new_tokens": 6 + (i * 5) % 19}
        if i % 2 == 0:
            body["temperature"] = 0
        else:
            body.update(
                temperature=0.9,
                seed=1000 + i,
                top_k=[0, 20][i % 4 == 1],
                top_p=[1.0, 0.9][i % 3 == 0],
            )
        if i % 5 == 0:
            body["stop"] = ["\n", "  "]
        out.append(body)
    return out


def metric(text: str, name: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


# -- in-process: batching, load, bad requests, streaming, tokens --------------------------


def test_concurrent_clients_get_their_one_at_a_time_completions(
    server: InferenceServer, model: nn.Module
):
    bodies = good_requests()
    expected = [reference(model, b) for b in bodies]
    start = threading.Barrier(len(bodies))

    def client(body: dict) -> tuple[int, Any, float]:
        start.wait()
        t0 = time.perf_counter()
        status, data = complete(server.url, body)
        return status, data, time.perf_counter() - t0

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(client, bodies))
    for body, (tokens, text), (status, data, _) in zip(bodies, expected, answers, strict=True):
        assert status == 200, data
        assert data["tokens"] == tokens, body
        assert data["completion"] == text
        usage = data["usage"]
        assert usage["prompt_tokens"] == len(encode_bytes(body["prompt"]))
        assert (
            usage["completion_tokens"]
            == len(tokens)
            == usage["total_tokens"] - usage["prompt_tokens"]
        )
        assert 0 <= data["timing"]["ttft_s"] <= data["timing"]["total_s"]
    latencies = sorted(a[2] for a in answers)
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    print(f"\n{len(bodies)} concurrent clients: p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    status, text, _ = request(server.url, "GET", "/metrics")
    assert status == 200
    batches = metric(text, "torsh_serve_batch_size_count")
    assert metric(text, "torsh_serve_batch_size_sum") == len(bodies)
    assert batches < len(bodies), "requests that arrived together were not batched"
    assert metric(text, "torsh_serve_generated_tokens_total") == sum(len(t) for t, _ in expected)
    assert metric(text, 'torsh_serve_requests_total{code="200",route="/v1/completions"}') == len(
        bodies
    )


BAD: list[tuple[bytes | dict, int, str]] = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"max_new_tokens": 4}, 400, "missing field: prompt"),
    ({"prompt": "x", "temprature": 0.5}, 400, "unknown field(s): temprature"),
    ({"prompt": 3}, 400, "prompt must be a non-empty string"),
    ({"prompt": "x", "max_new_tokens": "4"}, 400, "max_new_tokens must be an int"),
    ({"prompt": "x", "max_new_tokens": 0}, 400, "max_new_tokens must be an int >= 1"),
    ({"prompt": "x", "max_new_tokens": 33}, 400, "max_new_tokens must be <= 32"),
    ({"prompt": "x" * 65}, 400, "prompt is 65 tokens, longer than the model's context of 64"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature must be a finite number >= 0"),
    ({"prompt": "x", "stop": "\n"}, 400, "stop must be a list of non-empty strings"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream must be true or false"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "NaN is not valid JSON"),
    (b"{" + b" " * 5000 + b"}", 413, "more than the limit of 4096"),
]


def test_bad_requests_get_4xx_naming_the_field_and_good_ones_still_complete(
    server: InferenceServer, model: nn.Module
):
    good = good_requests()[:6]
    expected = [reference(model, b)[0] for b in good]
    jobs: list[tuple[str, Any]] = [("good", b) for b in good] + [("bad", b) for b in BAD]
    jobs = [jobs[i] for i in sorted(range(len(jobs)), key=lambda i: (i * 7) % len(jobs))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(
            pool.map(
                lambda job: complete(server.url, job[1] if job[0] == "good" else job[1][0]), jobs
            )
        )
    tokens = {}
    for (kind, job), (status, data) in zip(jobs, answers, strict=True):
        if kind == "good":
            assert status == 200, data
            tokens[job["prompt"]] = data["tokens"]
        else:
            _, code, message = job
            assert status == code and message in data["error"], (job, status, data)
    assert [tokens[b["prompt"]] for b in good] == expected
    status, data, headers = request(server.url, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST"
    assert request(server.url, "GET", "/nope")[0] == 404
    assert complete(server.url, good[0])[1]["tokens"] == expected[0]  # still serving


def test_streaming_sends_one_event_per_token_then_the_same_answer(server: InferenceServer):
    for body in (
        {"prompt": "def main():\n", "max_new_tokens": 12, "temperature": 0},
        {"prompt": "import ", "max_new_tokens": 20, "temperature": 0.8, "seed": 7, "top_k": 30},
    ):
        status, plain = complete(server.url, body)
        assert status == 200
        events = stream(server.url, body)
        names = [name for name, _ in events]
        assert names == ["token"] * len(plain["tokens"]) + ["done"]
        assert [d["token"] for _, d in events[:-1]] == plain["tokens"]
        assert [d["index"] for _, d in events[:-1]] == list(range(len(plain["tokens"])))
        final = events[-1][1]
        assert final["tokens"] == plain["tokens"] and final["completion"] == plain["completion"]
        assert final["stop_reason"] == plain["stop_reason"]


def test_health_and_metrics(server: InferenceServer):
    status, health, _ = request(server.url, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == {"name": "tiny"}
    assert health["max_seq_len"] == 64 and health["tp"] == 1
    complete(server.url, {"prompt": "x", "max_new_tokens": 2})
    complete(server.url, {"prompt": "x", "bogus": 1})
    status, text, headers = request(server.url, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in (
        "torsh_serve_requests_total",
        "torsh_serve_batch_size_bucket",
        "torsh_serve_request_latency_seconds_bucket",
        "torsh_serve_time_to_first_token_seconds_bucket",
        "torsh_serve_generated_tokens_total",
    ):
        assert name in text, name
    assert metric(text, 'torsh_serve_requests_total{code="400",route="/v1/completions"}') == 1
    assert metric(text, "torsh_serve_generated_tokens_total") == 2


def test_a_token_is_required_when_set_and_compared_exactly(model: nn.Module):
    config = ServerConfig(port=0, token=TOKEN)
    body = {"prompt": "x", "max_new_tokens": 2}
    with InferenceServer(TextGenerator(model), config, model_info={"name": "tiny"}) as srv:
        for headers in (
            {},
            {"Authorization": "Bearer wrong-token-0123456789abcde"},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": TOKEN},
            {"Authorization": f"Bearer {TOKEN}x"},
        ):
            status, data = complete(srv.url, body, headers)
            assert status == 401 and "token" in data["error"], headers
            assert request(srv.url, "GET", "/metrics", headers=headers)[0] == 401
        status, health, _ = request(srv.url, "GET", "/health")
        assert status == 200 and health == {"status": "ok"}  # no model details without it
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, data = complete(srv.url, body, auth)
        assert status == 200 and len(data["tokens"]) == 2
        assert request(srv.url, "GET", "/metrics", headers=auth)[0] == 200
        assert request(srv.url, "GET", "/health", headers=auth)[1]["model"] == {"name": "tiny"}


def test_config_refuses_a_public_address_without_a_token_and_weak_tokens():
    with pytest.raises(ValueError, match="0.0.0.0' is not a loopback address.*token is required"):
        ServerConfig(host="0.0.0.0", port=0)
    with pytest.raises(ValueError, match="server.token must be a string of at least 16"):
        ServerConfig(token="short")
    with pytest.raises(ValueError, match="server.max_batch_size must be an int > 0"):
        ServerConfig(max_batch_size=0)
    ServerConfig(host="::1")  # loopback: no token needed
    assert TOKEN not in repr(ServerConfig(host="0.0.0.0", token=TOKEN))


class Poisoned(nn.Module):
    """The checkpoint's GPT, failing any forward whose input holds byte 7 (BEL): a request that
    breaks generation after it passed validation."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.max_seq_len = inner.max_seq_len

    def _check(self, tokens: torch.Tensor) -> None:
        if bool((tokens == 7).any()):
            raise RuntimeError("poisoned input")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check(tokens)
        return self.inner(tokens)

    def forward_cached(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        self._check(tokens)
        return self.inner.forward_cached(tokens, cache)


def test_a_failing_request_gets_500_and_its_batch_mates_their_completions(model: nn.Module):
    config = ServerConfig(port=0, max_batch_size=8, batch_wait_ms=200)
    good = good_requests()[:5]
    expected = [reference(model, b)[0] for b in good]
    poison = {"prompt": "bad \x07 prompt", "max_new_tokens": 4}
    with InferenceServer(TextGenerator(Poisoned(model)), config) as srv:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda b: complete(srv.url, b), [poison, *good]))
        status, data = answers[0]
        assert status == 500 and "generation failed: RuntimeError" in data["error"]
        assert "poisoned" not in data["error"]  # internals stay in the server log
        assert [a[1]["tokens"] for a in answers[1:]] == expected
        status, text, _ = request(srv.url, "GET", "/metrics")
        assert metric(text, "torsh_serve_batch_size_count") < 6  # they did share a batch
        assert complete(srv.url, good[0])[1]["tokens"] == expected[0]
        assert request(srv.url, "GET", "/health")[0] == 200


# -- the command line ----------------------------------------------------------------------


class Served:
    """`torsh-dist serve ...` as a child process, its output in a file; killed at the end."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [*CLI, "serve", *args, "--port", str(self.port)],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def output(self) -> str:
        return self.log.read_text()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            if "listening on" in self.output():
                return
            time.sleep(0.1)
        raise AssertionError(f"not ready within {timeout} s:\n{self.output()}")

    def close(self) -> None:
        for child in self.children():
            child.kill()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []


def test_cli_refuses_a_public_address_without_a_token(
    checkpoint: str, capsys: pytest.CaptureFixture[str]
):
    from torsh_distributed.cli.main import main

    port = str(find_free_port())
    assert main(["serve", "--checkpoint", checkpoint, "--host", "0.0.0.0", "--port", port]) == 2
    err = capsys.readouterr().err
    assert "torsh-dist serve: error: server.host '0.0.0.0' is not a loopback address" in err
    assert "a token is required (--token-env VAR or --token-file FILE)" in err
    args = ["serve", "--checkpoint", checkpoint, "--port", port, "--token-env", "TORSH_NO_VAR"]
    assert main(args) == 2
    assert "the environment variable TORSH_NO_VAR is unset or empty" in capsys.readouterr().err


def test_cli_serves_with_a_token_file_and_stops_cleanly_on_sigterm(
    checkpoint: str, model: nn.Module, tmp_path: Path
):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    served = Served(
        ["--checkpoint", checkpoint, "--token-file", str(token_file), "--max-batch-size", "4"],
        tmp_path / "serve.log",
    )
    try:
        served.wait_ready()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        body = {"prompt": "def main():\n", "max_new_tokens": 10, "temperature": 0}
        assert complete(served.url, body)[0] == 401
        status, data = complete(served.url, body, auth)
        assert status == 200 and data["tokens"] == reference(model, body)[0]
        status, health, _ = request(served.url, "GET", "/health", headers=auth)
        assert health["model"]["step"] == 20 and health["max_batch_size"] == 4
        assert (
            "torsh_serve_requests_total" in request(served.url, "GET", "/metrics", headers=auth)[1]
        )
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(30) == 0, served.output()
        assert "SIGTERM: stopped cleanly" in served.output()
    finally:
        served.close()


def test_cli_tp2_serves_the_same_completions_and_releases_every_rank(
    checkpoint: str, model: nn.Module, tmp_path: Path
):
    served = Served(
        ["--checkpoint", checkpoint, "--tp", "2", "--batch-wait-ms", "50"],
        tmp_path / "serve-tp2.log",
    )
    try:
        served.wait_ready(timeout=180)
        bodies = good_requests()[:4]
        expected = [reference(model, b)[0] for b in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: complete(served.url, b), bodies))
        assert [a[0] for a in answers] == [200] * len(bodies), answers
        assert [a[1]["tokens"] for a in answers] == expected
        assert request(served.url, "GET", "/health")[1]["tp"] == 2
        assert [d["token"] for _, d in stream(served.url, bodies[0])[:-1]] == expected[0]
        ranks = served.children()
        assert (
            len([p for p in ranks if "torsh_distributed.cli.serve" in " ".join(p.cmdline())]) == 2
        )
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(60)
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks still running after SIGTERM: {alive}"
        out = served.output()
        assert "[rank0]: torsh-dist serve: SIGTERM: stopped cleanly" in out, out
        assert "Traceback" not in out, out
    finally:
        served.close()
