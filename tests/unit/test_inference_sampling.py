"""SamplingConfig validation and the sampler: greedy is the arg-max, seeds reproduce, top-k and
top-p restrict the support, and unfiltered sampling follows the softmax."""

from __future__ import annotations

import math

import pytest
import torch

from torsh_distributed.inference.sampling import (
    SamplingConfig,
    filter_logits,
    make_rng,
    sample_token,
)


def _draw(logits: torch.Tensor, config: SamplingConfig, n: int) -> list[int]:
    rng = make_rng(config.seed)
    return [sample_token(logits, config, rng) for _ in range(n)]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_new_tokens", 0, r"sampling.max_new_tokens must be an int >= 1, got 0"),
        ("max_new_tokens", 2.5, r"sampling.max_new_tokens"),
        ("temperature", -0.1, r"sampling.temperature must be a finite number >= 0"),
        ("temperature", math.inf, r"sampling.temperature"),
        ("temperature", math.nan, r"sampling.temperature"),
        ("top_k", -1, r"sampling.top_k must be an int >= 0"),
        ("top_k", 1.5, r"sampling.top_k"),
        ("top_p", 0.0, r"sampling.top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"sampling.top_p"),
        ("seed", -1, r"sampling.seed must be an int in \[0, 2\*\*64\)"),
        ("seed", 2**64, r"sampling.seed"),
        ("stop_tokens", (3, -1), r"sampling.stop_tokens must be token ids >= 0, got -1"),
        ("stop_strings", ("ok", ""), r"sampling.stop_strings must be non-empty strings"),
        ("stop_strings", "\n", r"must be sequences \(a tuple\), not a single string"),
    ],
)
def test_bad_values_name_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**{field: value})


def test_config_defaults_and_sequences() -> None:
    config = SamplingConfig(stop_tokens=[10, 13], stop_strings=["\n\n"])
    assert config.stop_tokens == (10, 13) and config.stop_strings == ("\n\n",)
    assert (config.temperature, config.top_k, config.top_p, config.seed) == (1.0, 0, 1.0, 0)
    assert SamplingConfig(temperature=0).greedy and not config.greedy
    with pytest.raises(TypeError):
        SamplingConfig(64)  # type: ignore[misc]  # keyword-only


def test_temperature_zero_is_the_argmax() -> None:
    logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(0))
    rng = make_rng(0)
    greedy = SamplingConfig(temperature=0, top_k=3, top_p=0.5)
    assert [sample_token(row, greedy, rng) for row in logits] == logits.argmax(dim=1).tolist()
    assert torch.equal(rng.get_state(), make_rng(0).get_state())  # greedy draws nothing
    # ties: the lowest token id
    assert sample_token(torch.tensor([0.0, 2.0, 2.0]), greedy, rng) == 1


def test_a_seed_reproduces_and_another_differs() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    config = SamplingConfig(temperature=1.5, seed=123)
    first = _draw(logits, config, 200)
    assert _draw(logits, config, 200) == first
    assert _draw(logits, SamplingConfig(temperature=1.5, seed=124), 200) != first
    # the device and dtype of the logits do not matter: they are sampled in float64 on the CPU
    assert _draw(logits.float(), config, 200) == _draw(logits.double(), config, 200)


def test_top_k_restricts_the_support() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(2))
    top = set(torch.topk(logits, 5).indices.tolist())
    # a high temperature flattens the distribution: without the filter, most of 64 tokens appear
    seen = set(_draw(logits, SamplingConfig(temperature=5.0, top_k=5, seed=3), 2000))
    assert seen == top
    unfiltered = set(_draw(logits, SamplingConfig(temperature=5.0, seed=3), 2000))
    assert len(unfiltered - top) > 30


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = probs.log()
    assert set(_draw(logits, SamplingConfig(top_p=0.8, seed=0), 1000)) == {1, 3}
    assert set(_draw(logits, SamplingConfig(top_p=0.81, seed=0), 1000)) == {1, 2, 3}
    assert set(_draw(logits, SamplingConfig(top_p=0.3, seed=0), 100)) == {1}  # top one always kept
    kept = filter_logits(logits, SamplingConfig(top_p=0.8))
    assert torch.isinf(kept).tolist() == [True, False, True, False, True]


def test_top_k_then_top_p() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=3 renormalises to 4/9, 3/9, 2/9: top_p=0.7 then needs the first two only
    config = SamplingConfig(top_k=3, top_p=0.7, seed=5)
    assert set(_draw(probs.log(), config, 500)) == {0, 1}


def test_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5])
    config = SamplingConfig(temperature=0.7, seed=11)
    n = 20000
    counts = torch.bincount(torch.tensor(_draw(logits, config, n)), minlength=5).double() / n
    expected = torch.softmax(logits.double() / 0.7, dim=0)
    # 4 standard deviations of a binomial proportion
    assert ((counts - expected).abs() < 4 * (expected * (1 - expected) / n).sqrt()).all(), counts


def test_bad_logits() -> None:
    config = SamplingConfig()
    with pytest.raises(ValueError, match=r"contain NaN"):
        sample_token(torch.tensor([0.0, math.nan]), config, make_rng(0))
    with pytest.raises(ValueError, match=r"one row of logits"):
        sample_token(torch.zeros(2, 3), config, make_rng(0))
    with pytest.raises(ValueError, match=r"needs temperature > 0"):
        filter_logits(torch.zeros(3), SamplingConfig(temperature=0))
