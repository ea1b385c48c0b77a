"""The built-in GPT's KV cache: incremental decoding gives the full forward's logits.

fp64 throughout, so "equal" means within 1e-10 (the differences are rounding of differently
shaped matrix products, ~1e-16).
"""

from __future__ import annotations

import pytest
import torch

from torsh_distributed.inference.cache import KVCache
from torsh_distributed.models.config import ModelConfig
from torsh_distributed.models.gpt import GPT

TOL = 1e-10
SHAPE = {"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 24, "vocab_size": 64}


def _gpt(**shape: int) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**{**SHAPE, **shape})).double().eval()


def _tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, SHAPE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


def _decode_in_chunks(
    model: GPT, x: torch.Tensor, chunks: list[int], cache: KVCache
) -> torch.Tensor:
    out, start = [], 0
    for size in chunks:
        out.append(model.forward_cached(x[:, start : start + size], cache))
        start += size
    return torch.cat(out, dim=1)


@pytest.mark.parametrize(
    "chunks",
    [[5] + [1] * 19, [1] * 24, [24], [7, 3, 5, 1, 8]],
    ids=["prefill-then-tokens", "token-by-token", "one-prefill", "uneven-chunks"],
)
def test_cached_logits_equal_full_recomputation_at_every_position(chunks: list[int]) -> None:
    model = _gpt()
    x = _tokens(3, 24)
    with torch.no_grad():
        full = model(x)
        cache = KVCache(batch_size=3, max_len=24)
        cached = _decode_in_chunks(model, x, chunks, cache)
    assert cached.shape == full.shape
    assert float((cached - full).abs().max()) < TOL
    assert cache.length == 24 and cache.num_layers == 2
    assert cache.layer(0).keys.shape == (3, 4, 24, 8)  # [batch, heads, slots, head_dim]


def test_left_padded_rows_compute_as_alone() -> None:
    model = _gpt()
    lengths = [4, 9, 6]
    x = _tokens(3, 9, seed=2)
    pad = [9 - n for n in lengths]
    padded = torch.stack(
        [
            torch.cat([torch.zeros(p, dtype=torch.long), row[:n]])
            for p, n, row in zip(pad, lengths, x, strict=True)
        ]
    )
    follow = _tokens(3, 5, seed=3)  # five decode steps after the prompts
    with torch.no_grad():
        cache = KVCache(batch_size=3, max_len=14, left_pad=pad)
        logits = [model.forward_cached(padded, cache)[:, -1:]]
        logits += [model.forward_cached(follow[:, i : i + 1], cache) for i in range(5)]
        got = torch.cat(logits, dim=1)  # [3, 6, vocab]: after the prompt, then each step
        for b, n in enumerate(lengths):
            alone = model(torch.cat([x[b, :n], follow[b]])[None])[0, n - 1 :]
            assert float((got[b] - alone).abs().max()) < TOL, f"row {b}"
    assert cache.next_positions.tolist() == [n + 5 for n in lengths]


def test_finished_rows_are_masked_and_stop_advancing() -> None:
    model = _gpt()
    x = _tokens(2, 12, seed=4)
    with torch.no_grad():
        cache = KVCache(batch_size=2, max_len=12)
        model.forward_cached(x[:, :6], cache)
        cache.finish([0])
        # row 0 is fed garbage from now on; row 1 must not notice
        garbage = torch.stack([torch.full((6,), 63), x[1, 6:]])
        steps = [model.forward_cached(garbage[:, i : i + 1], cache) for i in range(6)]
        got = torch.cat(steps, dim=1)[1]
        alone = model(x[1:])[0, 6:]
    assert float((got - alone).abs().max()) < TOL
    assert cache.next_positions.tolist() == [6, 12]
    assert torch.isfinite(torch.cat(steps, dim=1)).all()  # masked rows stay finite (no NaN)


def test_positions_past_block_size_raise_before_changing_the_cache() -> None:
    model = _gpt(block_size=8)
    x = _tokens(1, 9)
    cache = KVCache(batch_size=1, max_len=16)
    with torch.no_grad():
        model.forward_cached(x[:, :8], cache)
        with pytest.raises(ValueError, match=r"position 8 exceeds .*max sequence length 8"):
            model.forward_cached(x[:, 8:9], cache)
    assert cache.length == 8 and cache.next_positions.tolist() == [8]
    # the training forward keeps its own check
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds block_size 8"):
        model(x)


def test_left_padding_does_not_count_against_the_context() -> None:
    model = _gpt(block_size=8)
    cache = KVCache(batch_size=2, max_len=12, left_pad=[4, 0])
    with torch.no_grad():
        model.forward_cached(_tokens(2, 8), cache)
        cache.finish([1])  # the long row is done; the short one may go on to position 7
        for _ in range(4):
            model.forward_cached(_tokens(2, 1), cache)
    assert cache.next_positions.tolist() == [8, 8]


def test_cache_slots_and_arguments_are_checked() -> None:
    model = _gpt()
    cache = KVCache(batch_size=1, max_len=4)
    with torch.no_grad():
        model.forward_cached(_tokens(1, 3), cache)
        with pytest.raises(
            ValueError, match=r"holds max_len=4 slots; 3 are used and the forward adds 2"
        ):
            model.forward_cached(_tokens(1, 2), cache)
    with pytest.raises(ValueError, match=r"batch_size must be >= 1"):
        KVCache(batch_size=0, max_len=4)
    with pytest.raises(ValueError, match=r"max_len must be >= 1"):
        KVCache(batch_size=1, max_len=0)
    with pytest.raises(ValueError, match=r"left_pad must hold one count per row \(2\)"):
        KVCache(batch_size=2, max_len=4, left_pad=[1])
    with pytest.raises(ValueError, match=r"left_pad must be in \[0, max_len=4\)"):
        KVCache(batch_size=2, max_len=4, left_pad=[0, 4])
    with pytest.raises(ValueError, match=r"at least one token per row"):
        KVCache(batch_size=1, max_len=4).begin(0)
    other = KVCache(batch_size=2, max_len=4)
    other.begin(1)
    with pytest.raises(ValueError, match=r"expected keys for 2 rows and 1 new slots"):
        other.layer(0).update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))


def test_forward_cached_needs_the_whole_model() -> None:
    model = _gpt()
    model.head = None
    with pytest.raises(ValueError, match=r"needs the whole GPT, not a pipeline stage"):
        model.forward_cached(_tokens(1, 2), KVCache(batch_size=1, max_len=2))


def test_training_forward_is_unchanged_by_a_cache_in_use() -> None:
    """The training path takes no cache: same logits and gradients before and after decoding."""
    model = _gpt()
    x = _tokens(2, 24)
    first = model(x)
    with torch.no_grad():
        model.forward_cached(x[:, :10], KVCache(batch_size=2, max_len=10))
    again = model(x)
    assert torch.equal(first, again)
    again.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
