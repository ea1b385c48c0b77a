"""`torsh-dist serve` and `InferenceServer`: the OpenAI API over real HTTP on loopback, against a
checkpoint trained once per module by `torsh-dist train`, called with the official `openai`
client and with raw HTTP.

One in-process server per scheduler (continuous, static) serves most tests; a token server and
a failing model get their own. The CLI is started as a subprocess for startup refusal, a
single-process run with a token file and SIGTERM, and a `--tp 2` run through the launcher.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import torch
from torch import nn

from torsh_distributed.inference import SamplingConfig, TextGenerator, generate
from torsh_distributed.inference.chat import PYTHON_COMMENTS
from torsh_distributed.inference.load import load_gpt
from torsh_distributed.inference.server import InferenceServer, ServerConfig
from torsh_distributed.inference.text import decode_bytes, encode_bytes
from torsh_distributed.testing import find_free_port
from torsh_distributed.testing.cli import start_cli

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
def checkpoint(serve_checkpoint: str) -> str:
    return serve_checkpoint  # trained once per session (conftest), shared with test_serve_tls


@pytest.fixture(scope="module")
def model(checkpoint: str) -> nn.Module:
    return load_gpt(checkpoint)[0]


def _config(**kw: Any) -> ServerConfig:
    base = dict(port=0, max_batch_size=8, max_batch_tokens=96, batch_wait_ms=30,
                max_new_tokens_limit=40, max_body_bytes=4096)
    return ServerConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(model: nn.Module) -> Iterator[InferenceServer]:
    with InferenceServer(TextGenerator(model), _config(), model_info={"name": "tiny"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def static_server(model: nn.Module) -> Iterator[InferenceServer]:
    with InferenceServer(TextGenerator(model), _config(scheduler="static")) as srv:
        yield srv


def client(url: str, key: str = "EMPTY") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


# -- raw HTTP ------------------------------------------------------------------------------


def request(
    url: str,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:
    """(status, parsed JSON or text, headers)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read().decode()
        kind = resp.getheader("Content-Type", "")
        parsed = json.loads(raw) if kind.startswith("application/json") else raw
        return resp.status, parsed, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def complete(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, data, _ = request(url, "POST", "/v1/completions", body, headers)
    return status, data


def sampling_of(body: dict, prompt: str | None = None) -> SamplingConfig:
    stop = body.get("stop", ())
    return SamplingConfig(
        max_new_tokens=body.get("max_tokens", 16),
        temperature=body.get("temperature", 1.0),
        top_k=max(0, body.get("top_k", 0)),
        top_p=body.get("top_p", 1.0),
        seed=body.get("seed", 0),
        stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
    )


def reference(model: nn.Module, body: dict) -> tuple[list[int], str]:
    """The tokens and text `generate` gives for one request alone, in this process."""
    r = generate(model, encode_bytes(body["prompt"]), sampling_of(body), decode=decode_bytes)
    assert r.text is not None
    return r.tokens, r.text


def good_requests() -> list[dict]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 6 + (i * 5) % 30,
                                "return_token_ids": True}
        if i % 2 == 0:
            body["temperature"] = 0
        else:
            body.update(temperature=0.9, seed=1000 + i, top_k=[-1, 20][i % 4 == 1],
                        top_p=[1.0, 0.9][i % 3 == 0])
        if i % 5 == 0:
            body["stop"] = ["\n", "  "]
        out.append(body)
    return out


def as_kwargs(body: dict) -> dict:
    """A raw request body as the OpenAI client's keyword arguments (vLLM's extras in
    ``extra_body``)."""
    extras = {k: body[k] for k in ("top_k", "return_token_ids") if k in body}
    rest = {k: v for k, v in body.items() if k not in extras}
    return {**rest, "extra_body": extras} if extras else rest


def metric(text: str, name: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


# -- the OpenAI client ---------------------------------------------------------------------


def test_openai_client_lists_completes_streams_and_chats(server: InferenceServer, model: nn.Module):
    oc = client(server.url)
    assert [m.id for m in oc.models.list().data] == ["torsh-gpt"]
    body = {"prompt": "def main():\n", "max_tokens": 20, "temperature": 0}
    tokens, text = reference(model, body)
    plain = oc.completions.create(model="torsh-gpt", **body)
    assert plain.object == "text_completion" and plain.choices[0].text == text
    assert plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (12, 20)
    chunks = list(oc.completions.create(model="torsh-gpt", stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    # a list of prompts, n choices each, seeded: choice i samples with seed + i
    many = oc.completions.create(model="torsh-gpt", prompt=["import ", "x = "], n=2, seed=5,
                                 temperature=0.8, max_tokens=8)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    for c in many.choices:
        prompt = ["import ", "x = "][c.index // 2]
        ref = reference(model, {"prompt": prompt, "seed": 5 + c.index % 2, "temperature": 0.8,
                                "max_tokens": 8})
        assert c.text == ref[1]
    # chat: the template's prompt, its stop string added
    messages = [{"role": "system", "content": "Python."},
                {"role": "user", "content": "Count\nlines."}]
    prompt = PYTHON_COMMENTS.render(messages)
    assert prompt == "# system: Python.\n# user: Count\n# lines.\n# assistant:\n"
    ref = generate(model, encode_bytes(prompt),
                   SamplingConfig(max_new_tokens=12, temperature=0, stop_strings=PYTHON_COMMENTS.stop),
                   decode=decode_bytes)
    chat = oc.chat.completions.create(model="torsh-gpt", messages=messages, max_tokens=12,
                                      temperature=0)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ref.text
    assert chat.usage.prompt_tokens == len(encode_bytes(prompt))
    stream = list(oc.chat.completions.create(model="torsh-gpt", messages=messages, max_tokens=12,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == len(ref.tokens)
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        oc.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_logprobs_are_the_models_log_softmax(
    server: InferenceServer, static_server: InferenceServer, model: nn.Module
):
    oc = client(server.url)
    body = {"prompt": "def main():\n", "max_tokens": 6, "temperature": 0}
    tokens, text = reference(model, body)
    lp = oc.completions.create(model="torsh-gpt", logprobs=2, **body).choices[0].logprobs
    prompt = encode_bytes(body["prompt"])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1 :]
    expected = torch.log_softmax(logits.double(), dim=-1)
    assert len(lp.token_logprobs) == len(tokens) == 6
    for i, token in enumerate(tokens):
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i, token]), abs=1e-4)
        assert max(lp.top_logprobs[i].values()) == lp.token_logprobs[i]  # greedy: the top one
        assert len(lp.top_logprobs[i]) == 2
    assert lp.text_offset == [len(decode_bytes(tokens[:i])) for i in range(len(tokens))]
    chunks = oc.completions.create(model="torsh-gpt", logprobs=2, stream=True, **body)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((x.token_logprobs for x in streamed), []) == pytest.approx(lp.token_logprobs)
    assert sum((x.text_offset for x in streamed), []) == lp.text_offset
    chat = oc.chat.completions.create(model="torsh-gpt", messages=[{"role": "user", "content": "x"}],
                                      max_tokens=4, temperature=0, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 1 and len(c.bytes) >= 1 for c in content)
    with pytest.raises(openai.BadRequestError, match="logprobs needs the continuous scheduler"):
        client(static_server.url).completions.create(model="torsh-gpt", logprobs=1, **body)


def test_openai_client_with_a_token(model: nn.Module):
    with InferenceServer(TextGenerator(model), _config(token=TOKEN)) as srv:
        with pytest.raises(openai.AuthenticationError, match="missing or wrong token"):
            client(srv.url, "wrong-token-0123456789abcdef").models.list()
        oc = client(srv.url, TOKEN)
        assert oc.models.list().data[0].id == "torsh-gpt"
        body = {"prompt": "import ", "max_tokens": 10, "temperature": 0}
        assert oc.completions.create(model="torsh-gpt", **body).choices[0].text == reference(
            model, body)[1]
        streamed = oc.completions.create(model="torsh-gpt", stream=True, **body)
        assert "".join(c.choices[0].text for c in streamed) == reference(model, body)[1]
        for headers in ({}, {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN},
                        {"Authorization": f"Bearer {TOKEN}x"}):
            status, data = complete(srv.url, body, headers)
            assert status == 401 and data["error"]["code"] == "invalid_api_key", headers
            assert request(srv.url, "GET", "/metrics", headers=headers)[0] == 401
        status, health, _ = request(srv.url, "GET", "/health")
        assert status == 200 and health == {"status": "ok"}  # no model details without it
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert request(srv.url, "GET", "/health", headers=auth)[1]["model_name"] == "torsh-gpt"


# -- batching ------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["server", "static_server"])
def test_concurrent_clients_get_their_one_at_a_time_completions(
    which: str, request: pytest.FixtureRequest, model: nn.Module
):
    srv: InferenceServer = request.getfixturevalue(which)
    bodies = good_requests()
    expected = [reference(model, b) for b in bodies]
    start = threading.Barrier(len(bodies))

    def one(body: dict) -> tuple[int, Any]:
        start.wait()
        return complete(srv.url, body)

    before = request_metrics(srv)
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(one, bodies))
    for body, (tokens, text), (status, data) in zip(bodies, expected, answers, strict=True):
        assert status == 200, data
        assert data["choices"][0]["token_ids"] == tokens, body
        assert data["choices"][0]["text"] == text
        assert data["prompt_token_ids"] == [encode_bytes(body["prompt"])]
        assert data["usage"]["completion_tokens"] == len(tokens)
        reason = data["choices"][0]["finish_reason"]
        assert reason == ("length" if len(tokens) == body["max_tokens"] else "stop")
    after = request_metrics(srv)
    rows = metric(after, "torsh_serve_batch_size_sum") - metric(before, "torsh_serve_batch_size_sum")
    steps = metric(after, "torsh_serve_batch_size_count") - metric(
        before, "torsh_serve_batch_size_count")
    if which == "static_server":
        assert rows == len(bodies) and steps < len(bodies), "requests were not batched"
    else:  # one observation per decoding step: rows decoded together on average
        assert rows / steps > 2, (rows, steps)
    generated = metric(after, "torsh_serve_generated_tokens_total") - metric(
        before, "torsh_serve_generated_tokens_total")
    assert generated == sum(len(t) for t, _ in expected)


def request_metrics(srv: InferenceServer) -> str:
    status, text, _ = request(srv.url, "GET", "/metrics")
    assert status == 200
    return text


def test_a_short_request_finishes_while_a_long_one_decodes(server: InferenceServer):
    """Continuous batching: the short request joins the running batch instead of waiting."""
    long = {"prompt": "#", "max_tokens": 40, "temperature": 0, "stream": True}
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(long))
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # the long one is decoding
    status, data = complete(server.url, {"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert status == 200 and data["usage"]["completion_tokens"] == 2
    rest = resp.read().decode()
    conn.close()
    events = [line for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 10, "the long request had ended"


# -- bad requests --------------------------------------------------------------------------

BAD: list[tuple[bytes | dict, int, str]] = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"max_tokens": 4}, 400, "missing field: prompt"),
    ({"prompt": "x", "temprature": 0.5}, 400, "unknown field: temprature"),
    ({"prompt": 3}, 400, "prompt must be a string, a list of strings"),
    ({"prompt": ""}, 400, "the prompt encodes to no tokens"),
    ({"prompt": [[]]}, 400, "the prompt encodes to no tokens"),
    ({"prompt": [1, 300]}, 400, "token ids outside [0, 256)"),
    ({"prompt": "x", "max_tokens": "4"}, 400, "max_tokens must be an int >= 1"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be an int >= 1"),
    ({"prompt": "x", "max_tokens": 41}, 400, "max_tokens must be <= 40"),
    ({"prompt": "x" * 65}, 400, "the prompt is 65 tokens, longer than the model's context of 64"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p must be a number in (0, 1]"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature must be a finite number >= 0"),
    ({"prompt": "x", "top_k": -2}, 400, "top_k must be an int >= -1"),
    ({"prompt": "x", "n": 0}, 400, "n must be an int >= 1"),
    ({"prompt": "x", "n": 300}, 400, "more than the server's limit of 256"),
    ({"prompt": "x", "stop": [""]}, 400, "stop must hold 1 to 16 non-empty strings"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream must be true or false"),
    ({"prompt": "x", "logprobs": 6}, 400, "logprobs must be null or an int in [0, 5]"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty is not supported"),
    ({"prompt": "x", "seed": 2**64}, 400, "seed must be an int"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature must be a finite number"),
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
        answers = list(pool.map(
            lambda job: complete(server.url, job[1] if job[0] == "good" else job[1][0]), jobs))
    tokens = {}
    for (kind, job), (status, data) in zip(jobs, answers, strict=True):
        if kind == "good":
            assert status == 200, data
            tokens[job["prompt"]] = data["choices"][0]["token_ids"]
        else:
            _, code, message = job
            assert status == code and message in data["error"]["message"], (job, status, data)
            assert set(data["error"]) == {"message", "type", "param", "code"}
    assert [tokens[b["prompt"]] for b in good] == expected
    status, data, headers = request(server.url, "GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    assert request(server.url, "GET", "/nope")[0] == 404
    status, data, _ = request(server.url, "POST", "/v1/chat/completions", {"messages": []})
    assert status == 400 and "messages must be a non-empty list" in data["error"]["message"]
    assert "code=\"5" not in request_metrics(server)  # no 5xx at all
    assert complete(server.url, good[0])[1]["choices"][0]["token_ids"] == expected[0]


def test_raw_stream_is_openai_chunks_ending_in_done(server: InferenceServer, model: nn.Module):
    body = {"prompt": "import ", "max_tokens": 14, "temperature": 0.8, "seed": 7, "top_k": 30,
            "stream": True, "return_token_ids": True}
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    lines = [x for x in resp.read().decode().split("\n\n") if x]
    conn.close()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    tokens, text = reference(model, body)
    assert sum((c["choices"][0].get("token_ids") or [] for c in chunks), []) == tokens
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


def test_health_and_metrics(server: InferenceServer):
    status, health, _ = request(server.url, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == {"name": "tiny"}
    assert health["max_seq_len"] == 64 and health["tp"] == 1
    assert health["scheduler"] == "continuous"
    before = request_metrics(server)
    complete(server.url, {"prompt": "x", "max_tokens": 2})
    complete(server.url, {"prompt": "x", "bogus": 1})
    status, text, headers = request(server.url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("torsh_serve_requests_total", "torsh_serve_batch_size_bucket",
                 "torsh_serve_request_latency_seconds_bucket",
                 "torsh_serve_time_to_first_token_seconds_bucket",
                 "torsh_serve_generated_tokens_total"):
        assert name in text, name
    bad = 'torsh_serve_requests_total{code="400",route="/v1/completions"}'
    assert metric(text, bad) - metric(before, bad) == 1
    generated = "torsh_serve_generated_tokens_total"
    assert metric(text, generated) - metric(before, generated) == 2


def test_config_refuses_a_public_address_without_a_token_and_weak_tokens():
    with pytest.raises(ValueError, match="0.0.0.0' is not a loopback address.*token is required"):
        ServerConfig(host="0.0.0.0", port=0)
    with pytest.raises(ValueError, match="server.token must be a string of at least 16"):
        ServerConfig(token="short")
    with pytest.raises(ValueError, match="server.max_batch_size must be an int > 0"):
        ServerConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="server.scheduler must be one of continuous, static"):
        ServerConfig(scheduler="dynamic")  # type: ignore[arg-type]
    ServerConfig(host="::1")  # loopback: no token needed
    assert TOKEN not in repr(ServerConfig(host="0.0.0.0", token=TOKEN, insecure=True))


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


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_a_failing_request_gets_500_and_its_batch_mates_their_completions(
    model: nn.Module, scheduler: str
):
    config = _config(batch_wait_ms=200, scheduler=scheduler)
    good = good_requests()[:5]
    expected = [reference(model, b)[0] for b in good]
    poison = {"prompt": "bad \x07 prompt", "max_tokens": 4}
    with InferenceServer(TextGenerator(Poisoned(model)), config) as srv:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda b: complete(srv.url, b), [poison, *good]))
        status, data = answers[0]
        assert status == 500 and "generation failed: RuntimeError" in data["error"]["message"]
        assert data["error"]["type"] == "server_error"
        assert "poisoned" not in data["error"]["message"]  # internals stay in the server log
        assert [a[1]["choices"][0]["token_ids"] for a in answers[1:]] == expected
        assert complete(srv.url, good[0])[1]["choices"][0]["token_ids"] == expected[0]
        assert request(srv.url, "GET", "/health")[0] == 200


# -- the command line ----------------------------------------------------------------------


class Served:
    """`torsh-dist serve ...` as a child process, its output in a file; killed at the end."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = start_cli(  # a warm process (torsh_distributed.testing.cli)
            ["serve", *args, "--port", str(self.port)], output=log, env={**os.environ, **(env or {})}
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


def test_cli_answers_as_torsh_dist_generate_and_stops_cleanly_on_sigterm(
    checkpoint: str, tmp_path: Path
):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    served = Served(
        ["--checkpoint", checkpoint, "--token-file", str(token_file), "--max-batch-size", "4"],
        tmp_path / "serve.log",
    )
    try:
        out = tmp_path / "generated.json"
        proc = subprocess.run(
            [*CLI, "generate", "--checkpoint", checkpoint, "--prompt", "def main():\\n",
             "--max-new-tokens", "24", "--temperature", "0", "--output", str(out)],
            capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        generated = json.loads(out.read_text())
        served.wait_ready()
        oc = client(served.url, TOKEN)
        assert [m.id for m in oc.models.list().data] == ["ckpt"]
        answer = oc.completions.create(model="ckpt", prompt="def main():\n", max_tokens=24,
                                       temperature=0, extra_body={"return_token_ids": True})
        assert answer.choices[0].text == generated["completion"]
        assert answer.choices[0].model_extra["token_ids"] == generated["tokens"]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, health, _ = request(served.url, "GET", "/health", headers=auth)
        assert health["model"]["step"] == 20 and health["max_batch_size"] == 4
        assert complete(served.url, {"prompt": "x"})[0] == 401
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(30) == 0, served.output()
        assert "SIGTERM: stopped cleanly" in served.output()
    finally:
        served.close()


def test_cli_tp2_serves_the_openai_api_with_the_same_answers_and_releases_every_rank(
    checkpoint: str, model: nn.Module, tmp_path: Path
):
    served = Served(
        ["--checkpoint", checkpoint, "--tp", "2", "--token-env", "TORSH_TEST_SERVE_TOKEN"],
        tmp_path / "serve-tp2.log",
        env={"TORSH_TEST_SERVE_TOKEN": TOKEN},
    )
    try:
        served.wait_ready(timeout=180)
        oc = client(served.url, TOKEN)
        assert [m.id for m in oc.models.list().data] == ["ckpt"]
        bodies = good_requests()[:4]
        expected = [reference(model, b)[1] for b in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(
                lambda b: oc.completions.create(model="ckpt", **as_kwargs(b)).choices[0].text,
                bodies))
        assert answers == expected
        streamed = oc.completions.create(model="ckpt", stream=True, **as_kwargs(bodies[0]))
        assert "".join(c.choices[0].text for c in streamed) == expected[0]
        messages = [{"role": "user", "content": "hello"}]
        ref = generate(model, encode_bytes(PYTHON_COMMENTS.render(messages)),
                       SamplingConfig(max_new_tokens=8, temperature=0, stop_strings=PYTHON_COMMENTS.stop),
                       decode=decode_bytes)
        chat = oc.chat.completions.create(model="ckpt", messages=messages, max_tokens=8,
                                          temperature=0)
        assert chat.choices[0].message.content == ref.text
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert request(served.url, "GET", "/health", headers=auth)[1]["tp"] == 2
        ranks = served.children()
        assert (
            len([p for p in ranks if "torsh_distributed.cli.serve" in " ".join(p.cmdline())]) == 2
        )
        sent = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(60)
        # ranks that returned exit at once: torch's agent kept them waiting its whole 30 s
        # shutdown timeout, then SIGKILLed them (elastic/_agent.py)
        assert time.monotonic() - sent < 20, served.output()
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks still running after SIGTERM: {alive}"
        out = served.output()
        assert "[rank0]: torsh-dist serve: SIGTERM: stopped cleanly" in out, out
        assert "Traceback" not in out, out
    finally:
        served.close()
