"""World-size independent, resumable samplers: streams, sharding, fetching, state."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torsh_distributed.data import (
    DistributedBatchSampler,
    EpochSampler,
    GlobalSampler,
    ReplacementSampler,
    TokenWindows,
    check_sampler_state,
    fetch,
    shard,
)
from torsh_distributed.data.corpus import sample_batch

TOKENS = torch.randint(0, 256, (5_000,), generator=torch.Generator().manual_seed(7))


# ---- ReplacementSampler == the built-in trainer's sampling --------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 1234])
@pytest.mark.parametrize("block_size", [8, 33])
def test_replacement_sampler_draws_the_trainers_starts(seed, block_size):
    num_samples = TOKENS.numel() - block_size - 1
    sampler = ReplacementSampler(num_samples, global_batch=12, seed=seed)
    for step in (0, 1, 17, 10_000):
        # The starts exactly as corpus.sample_batch draws them.
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        expected = torch.randint(0, num_samples, (12,), generator=gen)
        got = sampler.indices(step)
        assert got.dtype == torch.int64 and torch.equal(got, expected)


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_token_windows_fetch_equals_sample_batch_bitwise(num_ranks):
    block_size, batch, seed = 16, 8, 5
    dataset = TokenWindows(TOKENS, block_size)
    assert len(dataset) == TOKENS.numel() - block_size - 1
    sampler = ReplacementSampler(len(dataset), global_batch=batch, seed=seed)
    for step in (0, 3, 99):
        for rank in range(num_ranks):
            mine = shard(sampler.indices(step), rank=rank, num_ranks=num_ranks)
            x, y = fetch(dataset, mine)
            ex, ey = sample_batch(
                TOKENS,
                seed=seed,
                step=step,
                batch_size=batch,
                block_size=block_size,
                rank=rank,
                num_ranks=num_ranks,
            )
            assert x.shape == (batch // num_ranks, block_size)
            assert torch.equal(x, ex) and torch.equal(y, ey)
            assert x.dtype == ex.dtype and y.dtype == ey.dtype


def test_token_windows_items_and_errors():
    tokens = torch.arange(10)
    dataset = TokenWindows(tokens, 3)
    assert len(dataset) == 6
    x, y = dataset[2]
    assert x.tolist() == [2, 3, 4] and y.tolist() == [3, 4, 5]
    assert dataset[-1][1].tolist() == dataset[5][1].tolist() == [6, 7, 8]
    pairs = dataset.__getitems__([0, 5, -6])
    assert [p[0].tolist() for p in pairs] == [[0, 1, 2], [5, 6, 7], [0, 1, 2]]
    with pytest.raises(IndexError, match="index 6 is out of range for 6"):
        dataset[6]
    with pytest.raises(IndexError, match="index -7"):
        dataset.__getitems__([1, -7])
    with pytest.raises(ValueError, match="block_size 9 needs at least 11"):
        TokenWindows(tokens, 9)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        TokenWindows(tokens, 0)
    with pytest.raises(ValueError, match="tokens must be 1-D"):
        TokenWindows(tokens.view(2, 5), 1)


# ---- EpochSampler -------------------------------------------------------------------------------


def test_epoch_sampler_covers_every_index_once_per_epoch():
    sampler = EpochSampler(20, global_batch=4, seed=3)
    assert sampler.batches_per_epoch == 5
    epochs = []
    for epoch in range(3):
        steps = range(epoch * 5, (epoch + 1) * 5)
        seen = torch.cat([sampler.indices(s) for s in steps])
        assert sorted(seen.tolist()) == list(range(20))
        assert all(sampler.epoch_of(s) == epoch for s in steps)
        epochs.append(seen)
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    assert not torch.equal(epochs[0], torch.arange(20))  # actually shuffled


def test_epoch_sampler_drops_the_last_partial_batch():
    sampler = EpochSampler(23, global_batch=4, seed=0)
    assert sampler.batches_per_epoch == 5
    seen = torch.cat([sampler.indices(s) for s in range(5)])
    assert len(set(seen.tolist())) == 20 and seen.max() < 23  # 3 samples unused, none repeated
    # The epoch's permutation is randperm seeded by the documented mix of (seed, epoch).
    perm = torch.randperm(23, generator=torch.Generator().manual_seed(0 * 1_000_003 + 1))
    assert torch.equal(sampler.indices(5), perm[:4]) and torch.equal(
        sampler.indices(9), perm[16:20]
    )


def test_epoch_sampler_is_pure_and_seeded():
    a = EpochSampler(50, global_batch=5, seed=1)
    b = EpochSampler(50, global_batch=5, seed=1)
    c = EpochSampler(50, global_batch=5, seed=2)
    order = [7, 0, 23, 7, 3]  # out of order and repeated: no hidden cursor
    assert all(torch.equal(a.indices(s), b.indices(s)) for s in order)
    assert not torch.equal(a.indices(0), c.indices(0))
    first = a.indices(0)
    first[0] = -1  # callers may modify what they get without corrupting the cache
    assert torch.equal(a.indices(0), b.indices(0))


def test_epoch_sampler_without_shuffle_is_in_order():
    sampler = EpochSampler(10, global_batch=3, shuffle=False)
    assert [sampler.indices(s).tolist() for s in range(4)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [0, 1, 2],
    ]


def test_samplers_reject_bad_settings():
    with pytest.raises(ValueError, match="num_samples 3 is smaller than global_batch 4"):
        EpochSampler(3, global_batch=4)
    for cls in (EpochSampler, ReplacementSampler):
        with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
            cls(0, global_batch=1)
        with pytest.raises(ValueError, match="global_batch must be >= 1, got -2"):
            cls(10, global_batch=-2)
        with pytest.raises(ValueError, match="step must be >= 0, got -1"):
            cls(10, global_batch=2).indices(-1)
        with pytest.raises(TypeError, match="seed must be an int"):
            cls(10, global_batch=2, seed=1.5)
        assert isinstance(cls(10, global_batch=2), GlobalSampler)


def test_state_dicts_name_the_settings():
    assert EpochSampler(10, global_batch=2, seed=4, shuffle=False).state_dict() == {
        "kind": "epoch",
        "num_samples": 10,
        "global_batch": 2,
        "seed": 4,
        "shuffle": False,
    }
    assert ReplacementSampler(10, global_batch=2, seed=4).state_dict() == {
        "kind": "replacement",
        "num_samples": 10,
        "global_batch": 2,
        "seed": 4,
    }


# ---- shard ----------------------------------------------------------------------------------------


def test_shard_splits_contiguously_and_rejects_indivisible():
    batch = torch.arange(100, 112)
    assert shard(batch, rank=0, num_ranks=3).tolist() == [100, 101, 102, 103]
    assert shard(batch, rank=2, num_ranks=3).tolist() == [108, 109, 110, 111]
    with pytest.raises(ValueError, match="global batch 12 is not divisible by num_ranks 5"):
        shard(batch, rank=0, num_ranks=5)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got 3"):
        shard(batch, rank=3, num_ranks=3)
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        shard(batch, rank=0, num_ranks=0)
    with pytest.raises(ValueError, match="indices must be 1-D"):
        shard(batch.view(3, 4), rank=0, num_ranks=1)


@pytest.mark.parametrize(
    "sampler", [EpochSampler(37, global_batch=8, seed=9), ReplacementSampler(37, global_batch=8)]
)
def test_every_world_size_sees_the_same_global_batch(sampler):
    for step in range(10):
        full = sampler.indices(step)
        for num_ranks in (1, 2, 4):
            parts = [
                shard(sampler.indices(step), rank=r, num_ranks=num_ranks) for r in range(num_ranks)
            ]
            assert torch.equal(torch.cat(parts), full)


# ---- fetch ----------------------------------------------------------------------------------------


class _ListDataset:
    def __init__(self, n: int) -> None:
        self.calls: list[int] = []
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.calls.append(i)
        return {"x": torch.tensor([float(i)]), "i": torch.tensor(i)}


class _BatchedDataset(_ListDataset):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.batched: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        self.batched.append(indices)
        return [{"x": torch.tensor([float(i)]), "i": torch.tensor(i)} for i in indices]


def test_fetch_uses_getitem_without_getitems():
    dataset = _ListDataset(10)
    batch = fetch(dataset, torch.tensor([4, 1, 7]))
    assert dataset.calls == [4, 1, 7]
    assert batch["i"].tolist() == [4, 1, 7] and batch["x"].shape == (3, 1)


def test_fetch_prefers_getitems_and_matches_a_dataloader():
    dataset = _BatchedDataset(10)
    batch = fetch(dataset, [4, 1, 7])
    assert dataset.batched == [[4, 1, 7]] and dataset.calls == []
    assert batch["i"].tolist() == [4, 1, 7]
    loader_batch = next(iter(DataLoader(dataset, batch_sampler=[[4, 1, 7]])))
    assert torch.equal(loader_batch["x"], batch["x"])
    assert fetch(dataset, [2, 3], collate=list)[1]["i"].item() == 3


def test_fetch_of_pairs_is_a_list_like_a_dataloaders():
    dataset = TensorDataset(torch.arange(10.0), torch.arange(10) * 2)
    got = fetch(dataset, torch.tensor([3, 5]))
    expected = next(iter(DataLoader(dataset, batch_sampler=[[3, 5]])))
    assert isinstance(got, list) and type(got) is type(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    with pytest.raises(ValueError, match="indices must be 1-D"):
        fetch(dataset, torch.zeros(2, 2, dtype=torch.long))


# ---- DistributedBatchSampler ----------------------------------------------------------------------


def test_batch_sampler_iterates_one_epoch_then_the_next():
    bs = DistributedBatchSampler(dataset_len=10, global_batch=4, seed=1, rank=1, num_ranks=2)
    stream = EpochSampler(10, global_batch=4, seed=1)
    assert len(bs) == 2 and bs.step == 0
    first = list(bs)
    assert first == [shard(stream.indices(s), rank=1, num_ranks=2).tolist() for s in (0, 1)]
    assert bs.step == 2 and len(bs) == 2  # the next epoch
    second = list(bs)
    assert second == [shard(stream.indices(s), rank=1, num_ranks=2).tolist() for s in (2, 3)]


def test_batch_sampler_advances_as_batches_are_handed_out():
    bs = DistributedBatchSampler(dataset_len=30, global_batch=3, rank=0, num_ranks=1)
    it = iter(bs)
    next(it)
    assert bs.step == 1 and len(bs) == 9
    next(it)
    assert bs.step == 2
    bs.step = 7  # mid-epoch: one iteration finishes the epoch
    assert len(bs) == 3 and len(list(bs)) == 3 and bs.step == 10
    with pytest.raises(ValueError, match="step must be >= 0"):
        bs.step = -1


def test_batch_sampler_with_num_steps_and_a_dataloader():
    dataset = TensorDataset(torch.arange(100))
    sampler = ReplacementSampler(100, global_batch=6, seed=2)
    bs = DistributedBatchSampler(sampler, rank=2, num_ranks=3, num_steps=5)
    loader = DataLoader(dataset, batch_sampler=bs)
    assert len(loader) == 5
    got = [batch[0] for batch in loader]
    assert [g.tolist() for g in got] == [
        shard(sampler.indices(s), rank=2, num_ranks=3).tolist() for s in range(5)
    ]
    assert bs.step == 5 and len(bs) == 0 and list(bs) == []


def test_batch_sampler_defaults_to_a_single_process():
    bs = DistributedBatchSampler(dataset_len=8, global_batch=4)
    assert (bs.rank, bs.num_ranks) == (0, 1)
    assert next(iter(bs)) == EpochSampler(8, global_batch=4).indices(0).tolist()


def test_batch_sampler_state_round_trip_across_world_sizes():
    stream = EpochSampler(64, global_batch=8, seed=11)
    four = [DistributedBatchSampler(stream, rank=r, num_ranks=4) for r in range(4)]
    for bs in four:
        for _ in zip(range(3), bs, strict=False):
            pass
    state = four[0].state_dict()
    assert state == {"step": 3, "sampler": stream.state_dict()}
    assert all(bs.state_dict() == state for bs in four)  # ranks are not part of the state
    two = [
        DistributedBatchSampler(dataset_len=64, global_batch=8, seed=11, rank=r, num_ranks=2)
        for r in range(2)
    ]
    for bs in two:
        bs.load_state_dict(state)
    batches = [next(iter(bs)) for bs in two]
    assert batches[0] + batches[1] == stream.indices(3).tolist()


def test_batch_sampler_load_names_the_differing_settings():
    state = DistributedBatchSampler(dataset_len=64, global_batch=32, rank=0, num_ranks=1)
    saved = state.state_dict()
    other = DistributedBatchSampler(dataset_len=64, global_batch=16, rank=0, num_ranks=1)
    with pytest.raises(ValueError, match="global_batch 32 in the checkpoint, 16 now"):
        other.load_state_dict(saved)
    reseeded = DistributedBatchSampler(dataset_len=64, global_batch=32, seed=1, num_ranks=1)
    with pytest.raises(ValueError, match="seed 0 in the checkpoint, 1 now"):
        reseeded.load_state_dict(saved)
    replacement = DistributedBatchSampler(
        ReplacementSampler(64, global_batch=32), rank=0, num_ranks=1, num_steps=4
    )
    with pytest.raises(
        ValueError,
        match="kind 'epoch' in the checkpoint, 'replacement' now; "
        "shuffle True in the checkpoint, absent now",
    ):
        replacement.load_state_dict(saved)
    with pytest.raises(ValueError, match="no 'step' entry"):
        other.load_state_dict({"sampler": other.sampler.state_dict()})
    assert other.step == 0  # a failed load changes nothing
    with pytest.raises(ValueError, match="num_samples 64 in the checkpoint, 65 now"):
        check_sampler_state(EpochSampler(65, global_batch=32), saved["sampler"])


def test_batch_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="pass either a sampler or both dataset_len"):
        DistributedBatchSampler(dataset_len=10)
    with pytest.raises(ValueError, match="not both"):
        DistributedBatchSampler(EpochSampler(10, global_batch=2), global_batch=2)
    with pytest.raises(ValueError, match="num_steps is required for ReplacementSampler"):
        DistributedBatchSampler(ReplacementSampler(10, global_batch=2))
    with pytest.raises(ValueError, match="global_batch 6 is not divisible by num_ranks 4"):
        DistributedBatchSampler(dataset_len=10, global_batch=6, rank=0, num_ranks=4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        DistributedBatchSampler(dataset_len=10, global_batch=2, rank=2, num_ranks=2)
    with pytest.raises(ValueError, match="pass rank too"):
        DistributedBatchSampler(dataset_len=10, global_batch=2, num_ranks=2)
    with pytest.raises(ValueError, match="num_steps must be >= 0"):
        DistributedBatchSampler(dataset_len=10, global_batch=2, num_steps=-1)
    with pytest.raises(TypeError, match="must implement GlobalSampler"):
        DistributedBatchSampler([1, 2, 3])  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="seed=3 and shuffle=True are ignored"):
        DistributedBatchSampler(EpochSampler(10, global_batch=2), seed=3)
