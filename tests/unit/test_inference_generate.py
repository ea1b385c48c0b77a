"""generate / generate_batch / TextGenerator on the built-in GPT (KV cache) and on a user model
(TinyLM, full recomputation), checked against an independent arg-max loop over full forwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torsh_distributed.inference import (
    SamplingConfig,
    TextGenerator,
    decode_bytes,
    encode_bytes,
    generate,
    generate_batch,
)
from torsh_distributed.inference.cache import KVCache
from torsh_distributed.inference.protocol import CachedCausalLM, CausalLM
from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT
from torsh_distributed.testing.models import TinyLM

GREEDY = SamplingConfig(temperature=0, max_new_tokens=12)
SAMPLED = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_new_tokens=12)
PROMPTS = [[5, 9, 2, 7, 1, 3, 3], [11], [4, 4, 8, 1], [2, 60, 31, 7, 7, 0, 12, 9, 40, 41]]


def _gpt(block_size: int = 32) -> GPT:
    torch.manual_seed(0)
    shape = {"n_layer": 2, "n_head": 4, "d_model": 32, "vocab_size": 64}
    return GPT(ModelConfig(block_size=block_size, **shape)).double()


def _tiny() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(vocab=64, seq=32).double()  # no max_seq_len attribute: passed where needed


@torch.no_grad()
def _argmax_loop(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The reference: a full forward over the whole sequence per token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def _letters(tokens: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in tokens)


def test_protocols() -> None:
    assert isinstance(_gpt(), CachedCausalLM) and isinstance(_gpt(), CausalLM)
    assert not isinstance(_tiny(), CachedCausalLM) and isinstance(_tiny(), CausalLM)


def test_gpt_cached_greedy_equals_full_recomputation() -> None:
    model = _gpt()
    for prompt in PROMPTS:
        cached = generate(model, prompt, GREEDY)
        assert cached.tokens == _argmax_loop(model, prompt, 12)
        assert generate(model, prompt, GREEDY, cache=False).tokens == cached.tokens
        assert cached.stop_reason == "max_tokens" and cached.prompt_tokens == prompt


def test_gpt_cached_sampling_equals_recomputed_sampling() -> None:
    model = _gpt()
    cached = generate(model, PROMPTS[0], SAMPLED, cache=True)
    assert generate(model, PROMPTS[0], SAMPLED, cache=False).tokens == cached.tokens
    assert generate(model, PROMPTS[0], SAMPLED).tokens == cached.tokens  # reproducible
    other = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, seed=8, max_new_tokens=12)
    assert generate(model, PROMPTS[0], other).tokens != cached.tokens


def test_user_model_without_cache_is_recomputed() -> None:
    model = _tiny()
    result = generate(model, torch.tensor(PROMPTS[0]), GREEDY)
    assert result.tokens == _argmax_loop(model, PROMPTS[0], 12)
    with pytest.raises(TypeError, match=r"TinyLM has no forward_cached.*cache=False"):
        generate(model, PROMPTS[0], GREEDY, cache=True)


@pytest.mark.parametrize("which", ["gpt", "tiny"])
def test_batch_equals_one_prompt_at_a_time(which: str) -> None:
    model = _gpt() if which == "gpt" else _tiny()
    # rows of different lengths that stop at different times: by a stop token, by their
    # max_new_tokens, by the context (32 positions)
    configs = [
        SamplingConfig(temperature=0, max_new_tokens=9),
        SamplingConfig(temperature=0, max_new_tokens=40),
        SamplingConfig(temperature=0.8, seed=3, max_new_tokens=12),
        SamplingConfig(temperature=0, max_new_tokens=12),
    ]
    alone = [generate(model, p, c, max_seq_len=32) for p, c in zip(PROMPTS, configs, strict=True)]
    # a stop token the first row meets halfway
    stop = alone[0].tokens[4]
    assert stop not in alone[0].tokens[:4]
    configs[0] = SamplingConfig(temperature=0, max_new_tokens=9, stop_tokens=(stop,))
    alone[0] = generate(model, PROMPTS[0], configs[0], max_seq_len=32)
    batch = generate_batch(model, PROMPTS, configs, max_seq_len=32)
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert [r.stop_reason for r in batch] == [r.stop_reason for r in alone]
    reasons = [r.stop_reason for r in batch]
    assert reasons[0] == "stop_token" and reasons[1] == "max_length" and reasons[3] == "max_tokens"
    assert len(batch[1].tokens) == 32 - len(PROMPTS[1]) + 1


def test_max_length_stops_at_the_context() -> None:
    model = _gpt(block_size=16)
    result = generate(model, list(range(10)), SamplingConfig(temperature=0, max_new_tokens=20))
    assert result.stop_reason == "max_length" and len(result.tokens) == 7
    assert result.tokens == _argmax_loop(model, list(range(10)), 7)
    assert generate(model, list(range(16)), GREEDY).tokens == _argmax_loop(
        model, list(range(16)), 1
    )
    with pytest.raises(
        ValueError, match=r"prompt 0 has 17 tokens, more than the model's max_seq_len 16"
    ):
        generate(model, list(range(17)), GREEDY)


def test_stop_strings_cut_the_text() -> None:
    model = _gpt()
    free = generate(model, PROMPTS[0], GREEDY, decode=_letters)
    assert free.text == _letters(free.tokens)
    stop = free.text[5:7]
    first = free.text.find(stop)  # the stop string may appear earlier than where it was taken
    config = SamplingConfig(temperature=0, max_new_tokens=12, stop_strings=(stop, "zzzz"))
    result = generate(model, PROMPTS[0], config, decode=_letters)
    assert result.stop_reason == "stop_string"
    assert result.text == free.text[:first]
    assert result.tokens == free.tokens[: first + 2]
    with pytest.raises(ValueError, match=r"stop_strings needs a decode function"):
        generate(model, PROMPTS[0], config)


def test_stop_token_is_kept_in_tokens_not_in_text() -> None:
    model = _gpt()
    free = generate(model, PROMPTS[2], GREEDY)
    stop = free.tokens[3]
    first = free.tokens.index(stop)
    config = SamplingConfig(temperature=0, max_new_tokens=12, stop_tokens=(stop,))
    result = generate(model, PROMPTS[2], config, decode=_letters)
    assert result.stop_reason == "stop_token"
    assert result.tokens == free.tokens[: first + 1]
    assert result.text == _letters(free.tokens[:first])


def test_timing_and_modes() -> None:
    model = _gpt()
    model.train()
    result = generate(model, PROMPTS[0], GREEDY)
    assert model.training and all(m.training for m in model.modules())  # restored
    assert len(result.token_latencies_s) == len(result.tokens) == 12
    assert all(t > 0 for t in result.token_latencies_s)
    assert result.time_to_first_token_s == result.token_latencies_s[0]
    assert result.time_per_output_token_s == pytest.approx(sum(result.token_latencies_s[1:]) / 11)
    one = generate(model, PROMPTS[0], SamplingConfig(temperature=0, max_new_tokens=1))
    assert one.time_per_output_token_s is None


def test_bad_arguments() -> None:
    model = _gpt()
    with pytest.raises(ValueError, match=r"prompts is empty"):
        generate_batch(model, [], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        generate_batch(model, [[1], []], GREEDY)
    with pytest.raises(ValueError, match=r"got 1 sampling configs for 2 prompts"):
        generate_batch(model, [[1], [2]], [GREEDY])
    with pytest.raises(ValueError, match=r"prompt 0 holds a negative token id -3"):
        generate(model, [1, -3], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 0 must be 1-D"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), GREEDY)


def test_text_generator_with_the_byte_tokenizer() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=16, block_size=64)).double()
    prompts = ["def f(x):", "import os\n", "é"]
    assert decode_bytes(encode_bytes(prompts[2])) == "é" and len(encode_bytes("é")) == 2
    greedy = SamplingConfig(temperature=0, max_new_tokens=8)
    results = TextGenerator(model, max_batch_size=2).generate(prompts, greedy)
    assert [r.prompt_tokens for r in results] == [encode_bytes(p) for p in prompts]
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == generate(model, encode_bytes(prompt), greedy).tokens
        assert result.text == decode_bytes(result.tokens)
    per_prompt = [greedy, SAMPLED, greedy]
    again = TextGenerator(model, max_batch_size=8).generate(prompts, per_prompt)
    assert again[0].tokens == results[0].tokens
    assert again[1].tokens == generate(model, encode_bytes(prompts[1]), SAMPLED).tokens
    assert TextGenerator(model).generate([]) == []
    with pytest.raises(ValueError, match=r"max_batch_size must be >= 1"):
        TextGenerator(model, max_batch_size=0)


def test_inference_core_imports_no_upper_layer_or_built_in_model() -> None:
    root = Path(__file__).resolve().parents[2] / "src" / "torsh_distributed" / "inference"
    banned = ("engine", "train", "cli", "models")
    for name in ("__init__", "cache", "sampling", "generate", "_decode", "protocol", "text"):
        tree = ast.parse((root / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                assert not (
                    parts[0] == "torsh_distributed" and len(parts) > 1 and parts[1] in banned
                ), f"inference/{name}.py imports {node.module}"


class _CachedTinyLM(TinyLM):
    """A user model made cacheable by the three KVCache calls (as in docs/inference.md)."""

    def forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        step = cache.begin(tokens.shape[1], max_positions=self.pos.num_embeddings)
        x = self.embed(tokens) + self.pos(step.positions)
        for i, layer in enumerate(self.layers):
            attn, (b, t, _) = layer.attn, x.shape
            h = layer.norm1(x)
            q, k, v = (
                p(h).reshape(b, t, -1, attn.head_dim).transpose(1, 2)
                for p in (attn.q, attn.k, attn.v)
            )
            k, v = cache.layer(i).update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask)
            x = x + attn.o(y.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.norm2(x))))
        return self.out(self.norm(x))


def test_a_user_model_with_forward_cached_decodes_like_recomputation() -> None:
    torch.manual_seed(0)
    model = _CachedTinyLM(vocab=64, seq=32).double()
    assert isinstance(model, CachedCausalLM)
    configs = [GREEDY, SAMPLED, GREEDY, SAMPLED]
    cached = generate_batch(model, PROMPTS, configs, max_seq_len=32)
    recomputed = generate_batch(model, PROMPTS, configs, cache=False, max_seq_len=32)
    assert [r.tokens for r in cached] == [r.tokens for r in recomputed]
    assert cached[0].tokens == _argmax_loop(model, PROMPTS[0], 12)
