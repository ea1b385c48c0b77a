"""The standard-library corpus and the deterministic sampler."""

from __future__ import annotations

import pytest
import torch

from torsh_distributed.data.corpus import load_corpus, sample_batch
from torsh_distributed.train.config import DataConfig


def test_corpus_is_deterministic_and_split():
    a = load_corpus(DataConfig(max_bytes=1_000_000))
    b = load_corpus(DataConfig(max_bytes=1_000_000))
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.numel() > a.val.numel() > 0
    assert a.train.numel() + a.val.numel() >= 1_000_000
    assert int(a.train.max()) < 256


def test_split_is_by_file_name_not_by_size():
    small = load_corpus(DataConfig(max_bytes=1_000_000))
    big = load_corpus(DataConfig(max_bytes=2_000_000))
    assert torch.equal(big.val[: small.val.numel()], small.val)  # a prefix: same files first


def test_missing_root_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(DataConfig(root=str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match="no .py files"):
        load_corpus(DataConfig(root=str(tmp_path)))


def test_too_small_corpus_names_the_fix(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="raise data.max_bytes"):
        load_corpus(DataConfig(root=str(tmp_path), val_percent=50), min_tokens=1000)


def test_rank_shares_concatenate_to_the_global_batch():
    tokens = torch.arange(10_000)
    x, y = sample_batch(tokens, seed=3, step=7, batch_size=8, block_size=16)
    parts = [sample_batch(tokens, seed=3, step=7, batch_size=8, block_size=16, rank=r, num_ranks=4)
             for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(y[:, :-1], x[:, 1:])
    other, _ = sample_batch(tokens, seed=3, step=8, batch_size=8, block_size=16)
    assert not torch.equal(other, x)


def test_small_corpus_still_has_a_validation_split():
    corpus = load_corpus(DataConfig(max_bytes=100_000))
    assert corpus.val.numel() > 0 and corpus.train.numel() > corpus.val.numel()
