"""Inference on CUDA: KV-cache decoding against full recomputation, batched against one at a time,
and the OpenAI-compatible server answering over HTTP from a model on the GPU (with the official
``openai`` client where it is installed). Skipped without CUDA.
"""

from __future__ import annotations

import http.client
import json

import pytest
import torch

from torsh_distributed.inference import SamplingConfig, TextGenerator, generate, generate_batch
from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, d_model=128)
    return GPT(cfg).cuda().eval()


def test_kv_cache_decoding_matches_recomputation_on_cuda(model: GPT):
    prompt = list(b"def main():\n    ")
    greedy = SamplingConfig(max_new_tokens=48, temperature=0)
    cached = generate(model, prompt, greedy, cache=True, tp_group=None)
    full = generate(model, prompt, greedy, cache=False, tp_group=None)
    assert cached.tokens == full.tokens
    assert len(cached.tokens) == 48


def test_batched_decoding_matches_one_at_a_time_on_cuda(model: GPT):
    prompts = [list(b"import os\n"), list(b"class A:\n    def f(self"), list(b"x = [")]
    greedy = SamplingConfig(max_new_tokens=24, temperature=0)
    batched = generate_batch(model, prompts, greedy, tp_group=None)
    for prompt, got in zip(prompts, batched, strict=True):
        assert got.tokens == generate(model, prompt, greedy, tp_group=None).tokens


def _post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_openai_server_from_a_cuda_model(model: GPT):
    pytest.importorskip("fastapi", reason="pip install 'torsh-distributed[serve]'")
    from torsh_distributed.inference.server import InferenceServer, ServerConfig

    config = ServerConfig(port=0, max_batch_size=8, max_batch_tokens=96, batch_wait_ms=30,
                          max_new_tokens_limit=40, max_body_bytes=4096)
    prompt = "def main():\n"
    ref = TextGenerator(model).generate([prompt], SamplingConfig(max_new_tokens=16,
                                                                 temperature=0))[0]
    with InferenceServer(TextGenerator(model), config) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        status, data = _post(port, {"prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert status == 200, data
        assert data["choices"][0]["text"] == ref.text
        try:
            import openai
        except ImportError:
            return
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="EMPTY", max_retries=0,
                               timeout=60)
        got = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                        max_tokens=16, temperature=0)
        assert got.choices[0].text == ref.text
