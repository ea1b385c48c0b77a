"""Continuous batching (`ContinuousBatcher` over `SlotKVCache`), the OpenAI request checks, the
streamed text and the chat template: one process, a small random GPT, no HTTP."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from torsh_distributed.inference import SamplingConfig, TextGenerator, generate
from torsh_distributed.inference import _openai as oa
from torsh_distributed.inference._continuous import ContinuousBatcher, Join
from torsh_distributed.inference.chat import PYTHON_COMMENTS
from torsh_distributed.inference.text import TextStream, decode_bytes, encode_bytes
from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(block_size=64, n_layer=2, n_head=2, d_model=32)).eval()


def drive(engine: ContinuousBatcher, joins: list[Join], *, per_step: int = 99) -> tuple[dict, int]:
    """Admit ``joins`` in order as the server does (at most ``per_step`` a step), run to the
    end; (results by id, steps)."""
    queue, results, steps = list(joins), {}, 0
    while queue or engine.running:
        now: list[Join] = []
        tokens = 0
        while queue and len(now) < per_step and engine.admits(
            len(queue[0].prompt), joining=len(now), joining_tokens=tokens
        ):
            now.append(queue.pop(0))
            tokens += len(now[-1].prompt)
        for rid, kind, value in engine.step(now):
            if kind == "done":
                results[rid] = value
            elif kind == "error":
                results[rid] = value
        steps += 1
    return results, steps


def workload(count: int, seed: int = 0) -> list[Join]:
    rnd = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rnd.randrange(256) for _ in range(rnd.randint(1, 40))]
        sampling = SamplingConfig(max_new_tokens=rnd.randint(1, 30),
                                  temperature=rnd.choice([0, 0.8]), top_k=rnd.choice([0, 20]),
                                  seed=i)
        out.append(Join(id=i, prompt=prompt, sampling=sampling))
    return out


def test_rows_joining_and_leaving_get_the_tokens_generate_gives_them_alone(model: GPT):
    joins = workload(12)
    engine = ContinuousBatcher(TextGenerator(model), max_rows=4, max_len=64, max_batch_tokens=100)
    results, steps = drive(engine, joins, per_step=2)  # 2 a step: they join over many steps
    for j in joins:
        alone = generate(model, j.prompt, j.sampling, decode=decode_bytes)
        assert results[j.id].tokens == alone.tokens, j.id
        assert results[j.id].text == alone.text and results[j.id].stop_reason == alone.stop_reason
    assert steps < sum(j.sampling.max_new_tokens for j in joins)  # rows did run together


def test_a_row_runs_into_the_context_and_stops_with_max_length(model: GPT):
    join = Join(id=0, prompt=list(range(60)), sampling=SamplingConfig(max_new_tokens=20,
                                                                       temperature=0))
    engine = ContinuousBatcher(TextGenerator(model), max_rows=2, max_len=64, max_batch_tokens=99)
    result = drive(engine, [join])[0][0]
    alone = generate(model, join.prompt, join.sampling)
    assert result.stop_reason == "max_length" == alone.stop_reason
    assert result.tokens == alone.tokens and len(result.tokens) == 5


def test_admission_respects_rows_and_the_token_budget(model: GPT):
    engine = ContinuousBatcher(TextGenerator(model), max_rows=3, max_len=64, max_batch_tokens=30)
    assert engine.admits(50, joining=0, joining_tokens=0)  # a lone row always fits
    assert not engine.admits(20, joining=1, joining_tokens=15)  # 35 > 30
    assert engine.admits(15, joining=1, joining_tokens=15)
    assert not engine.admits(1, joining=3, joining_tokens=3)  # rows full
    engine.step([Join(id=0, prompt=[1] * 10, sampling=SamplingConfig(max_new_tokens=9))])
    assert engine.running == 1
    assert engine.admits(29, joining=0, joining_tokens=0)  # 1 decode token + 29
    assert not engine.admits(30, joining=0, joining_tokens=0)


def test_cancelled_rows_leave_and_the_others_are_unchanged(model: GPT):
    joins = workload(4, seed=3)
    engine = ContinuousBatcher(TextGenerator(model), max_rows=4, max_len=64, max_batch_tokens=999)
    events = engine.step(joins)
    assert {rid for rid, kind, _ in events if kind == "token"} == {0, 1, 2, 3}
    engine.step([], cancel=[1])
    results, _ = drive(engine, [])
    assert 1 not in results
    for j in joins:
        if j.id in results:
            assert results[j.id].tokens == generate(model, j.prompt, j.sampling).tokens


class Poisoned(nn.Module):
    """Fails any forward whose input holds token 7."""

    def __init__(self, inner: GPT) -> None:
        super().__init__()
        self.inner = inner
        self.max_seq_len = inner.max_seq_len

    def forward(self, tokens: torch.Tensor) -> Any:
        return self.inner(tokens)

    def forward_cached(self, tokens: torch.Tensor, cache: Any) -> Any:
        if bool((tokens == 7).any()):
            raise RuntimeError("poisoned")
        return self.inner.forward_cached(tokens, cache)


def test_a_failing_row_ends_with_its_error_and_the_others_finish(model: GPT):
    greedy = SamplingConfig(max_new_tokens=12, temperature=0)
    joins = [Join(id=0, prompt=[1, 2, 3], sampling=greedy),
             Join(id=1, prompt=[4, 7, 5], sampling=greedy),  # fails at prefill
             Join(id=2, prompt=[9, 9], sampling=greedy)]
    engine = ContinuousBatcher(TextGenerator(Poisoned(model)), max_rows=4, max_len=64,
                               max_batch_tokens=999)
    results, _ = drive(engine, joins)
    assert isinstance(results[1], RuntimeError)
    for j in (joins[0], joins[2]):
        assert results[j.id].tokens == generate(model, j.prompt, j.sampling).tokens


# -- OpenAI request checks ----------------------------------------------------------------

LIMITS = oa.Limits(max_seq_len=64, max_new_tokens_limit=32, max_total_tokens=None, max_rows=8,
                   vocab_size=256)


def plan(body: bytes, kind: str = "completion") -> oa.Plan:
    common: dict[str, Any] = {"model_name": "m", "encode": encode_bytes, "limits": LIMITS}
    if kind == "chat":
        return oa.plan_chat(oa.parse(oa.ChatCompletionRequest, body), template=PYTHON_COMMENTS,
                            **common)
    return oa.plan_completion(oa.parse(oa.CompletionRequest, body), **common)


def test_a_completion_request_becomes_prompts_times_n_rows():
    p = plan(b'{"model": "m", "prompt": ["ab", "c"], "n": 2, "seed": 5, "stop": "\\n", '
             b'"top_k": -1, "temperature": 0.5, "user": "u"}')
    assert [(c.prompt_index, c.tokens, c.sampling.seed) for c in p.choices] == [
        (0, [97, 98], 5), (0, [97, 98], 6), (1, [99], 5), (1, [99], 6)]
    s = p.choices[0].sampling
    assert (s.max_new_tokens, s.temperature, s.top_k, s.stop_strings) == (16, 0.5, 0, ("\n",))
    assert plan(b'{"prompt": [[1, 2], [3]]}').choices[1].tokens == [3]
    assert plan(b'{"prompt": [1, 2]}').choices[0].tokens == [1, 2]
    seeds = {plan(b'{"prompt": "x"}').choices[0].sampling.seed for _ in range(3)}
    assert len(seeds) == 3  # no seed: a fresh one per request


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"prompt": "x", "n": 9}', 400, "9 choices, more than the server's limit of 8"),
        (b'{"prompt": "x", "max_tokens": 33}', 400, "max_tokens must be <= 32"),
        (b'{"prompt": "x", "echo": true}', 400, "echo is not supported"),
        (b'{"prompt": "x", "best_of": 3}', 400, "only best_of == n"),
        (b'{"prompt": "x", "logit_bias": {"1": 2}}', 400, "logit_bias is not supported"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "needs stream"),
        (b'{"prompt": "x", "model": "other"}', 404, "does not exist"),
        (b'{"prompt": []}', 400, "prompt must not be an empty list"),
    ],
)
def test_completion_requests_refused_name_the_field(body: bytes, status: int, message: str):
    with pytest.raises(oa.APIError, match=message) as info:
        plan(body)
    assert info.value.status == status


def test_a_chat_request_renders_the_template_and_adds_its_stop():
    p = plan(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],'
             b' "max_completion_tokens": 5}', "chat")
    assert decode_bytes(p.choices[0].tokens) == "# user: hi\n# assistant:\n"
    assert p.choices[0].sampling.stop_strings == ("\n# user:", "\n# user (")
    assert p.choices[0].sampling.max_new_tokens == 5
    default = plan(b'{"messages": [{"role": "user", "content": "hi"}]}', "chat")
    assert default.choices[0].sampling.max_new_tokens == 32  # the server's limit
    with pytest.raises(oa.APIError, match="top_logprobs needs logprobs: true"):
        plan(b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "chat")
    assert plan(b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}',
                "chat").logprobs == 0
    with pytest.raises(oa.APIError, match="tools is not supported"):
        plan(b'{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}', "chat")
    with pytest.raises(oa.APIError, match="messages.0.role"):
        plan(b'{"messages": [{"role": "robot", "content": "x"}]}', "chat")


def test_a_chat_messages_name_is_rendered_or_refused_never_dropped():
    p = plan(b'{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "name": "alice", "content": "hi"}]}', "chat")
    assert decode_bytes(p.choices[0].tokens) == "# system: be brief\n# user (alice): hi\n# assistant:\n"
    for bad in (b'""', b'"a\\nb"'):
        with pytest.raises(oa.APIError, match=r"messages\[1\].name must be a non-empty name on one line") as info:
            plan(b'{"messages": [{"role": "user", "content": "x"}, {"role": "user", "name": ' + bad + b', "content": "y"}]}', "chat")
        assert (info.value.status, info.value.param) == (400, "messages[1].name")


def test_streamed_text_holds_back_a_partial_stop_string_and_utf8_character():
    stream = TextStream(decode_bytes, stop_strings=("END",))
    out = [stream.push(t) for t in encode_bytes("ab EN")]
    assert "".join(out) == "ab "  # "EN" may begin the stop string
    assert stream.push(ord("D")) == ""  # it did: nothing after the cut
    assert stream.finish("ab ") == ""
    euro = TextStream(decode_bytes)
    pieces = [euro.push(t) for t in "x€y".encode()]
    assert pieces == ["x", "", "", "€", "y"]  # the 3 bytes of the euro sign released together
    assert euro.finish("x€y") == ""
