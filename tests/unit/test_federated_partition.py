"""Partitioners of federated data: IID, Dirichlet, shards, labels of a dataset, the corpus by
package."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from torsh_distributed.data.config import DataConfig
from torsh_distributed.data.corpus import TokenWindows, load_corpus
from torsh_distributed.federated.partition import (
    corpus_by_package,
    dataset_labels,
    describe,
    partition_dirichlet,
    partition_iid,
    partition_indices,
    partition_shards,
)

LABELS = [k for k in range(10) for _ in range(200)]  # 10 classes x 200 items, sorted


def _check_cover(parts: list[list[int]], num_items: int) -> None:
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(num_items)), "not a partition: items lost or repeated"


def _entropy(part: list[int], labels: list[int]) -> float:
    counts = Counter(labels[i] for i in part)
    n = sum(counts.values())
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def test_iid_is_an_equal_deterministic_partition():
    parts = partition_iid(103, num_clients=5, seed=7)
    _check_cover(parts, 103)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert partition_iid(103, num_clients=5, seed=7) == parts
    assert partition_iid(103, num_clients=5, seed=8) != parts


def test_dirichlet_partitions_and_is_deterministic():
    parts = partition_dirichlet(LABELS, num_clients=8, alpha=0.5, seed=3)
    _check_cover(parts, len(LABELS))
    assert all(parts)
    assert partition_dirichlet(LABELS, num_clients=8, alpha=0.5, seed=3) == parts
    assert partition_dirichlet(LABELS, num_clients=8, alpha=0.5, seed=4) != parts


def test_small_alpha_is_more_skewed_than_large_alpha():
    def mean_entropy(alpha: float, seed: int) -> float:
        parts = partition_dirichlet(LABELS, num_clients=10, alpha=alpha, seed=seed)
        return sum(_entropy(p, LABELS) for p in parts) / len(parts)

    for seed in range(3):
        skewed, near_iid = mean_entropy(0.1, seed), mean_entropy(100.0, seed)
        # IID would be log2(10) = 3.32 bits per client; alpha 100 is close to it
        assert near_iid > 0.9 * math.log2(10)
        assert skewed < near_iid - 1.0, (skewed, near_iid)  # at least a bit less per client


def test_dirichlet_min_size_that_cannot_be_met_names_alpha_and_min_size():
    labels = [0] * 100 + [1] * 100
    with pytest.raises(ValueError, match=r"alpha=0\.001 .*min_size=5"):
        partition_dirichlet(labels, num_clients=20, alpha=0.001, seed=0, min_size=5)
    with pytest.raises(ValueError, match="at least 300 items"):
        partition_dirichlet(labels, num_clients=30, alpha=1.0, seed=0, min_size=10)


def test_shards_give_each_client_few_labels():
    for spc in (1, 2, 3):
        parts = partition_shards(LABELS, num_clients=5, shards_per_client=spc, seed=spc)
        _check_cover(parts, len(LABELS))
        assert all(len({LABELS[i] for i in p}) <= 2 * spc for p in parts)
        assert partition_shards(LABELS, num_clients=5, shards_per_client=spc, seed=spc) == parts
    # the pathological split: 10 clients x 2 shards of one label each
    parts = partition_shards(LABELS, num_clients=10, shards_per_client=2, seed=0)
    assert all(len({LABELS[i] for i in p}) <= 2 for p in parts)


class _Pairs:
    """A map-style dataset without any label attribute: labels are read item by item."""

    def __init__(self, labels: list[int]) -> None:
        self.items = [(torch.zeros(2), torch.tensor(k)) for k in labels]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class _WithTargets(_Pairs):
    def __init__(self, labels: list[int]) -> None:
        super().__init__(labels)
        self.targets = list(labels)

    def __getitem__(self, i: int):
        raise AssertionError("the targets attribute must be used instead of reading items")


def test_dataset_labels_fast_paths_and_item_reading():
    labels = [3, 1, 4, 1, 5, 9, 2, 6]
    assert dataset_labels(_Pairs(labels)) == labels
    assert dataset_labels(_WithTargets(labels)) == labels
    tensors = TensorDataset(torch.zeros(8, 2), torch.tensor(labels))
    assert dataset_labels(tensors) == labels
    assert dataset_labels(Subset(_WithTargets(labels), [5, 0])) == [9, 3]


def test_dataset_labels_refuses_sequence_targets_and_names_iid():
    windows = TokenWindows(torch.arange(100), 8)
    with pytest.raises(ValueError, match=r"not a scalar class label.*iid"):
        dataset_labels(windows)
    floats = TensorDataset(torch.zeros(4, 2), torch.rand(4, 3))
    with pytest.raises(ValueError, match="iid"):
        dataset_labels(floats)
    with pytest.raises(ValueError, match="iid"):
        partition_indices("dirichlet", windows, num_clients=2, seed=0)


def test_partition_indices_dispatches_and_refuses_bad_input():
    data = TensorDataset(torch.zeros(len(LABELS), 1), torch.tensor(LABELS))
    iid = partition_indices("iid", data, num_clients=4, seed=1)
    assert iid == partition_iid(len(LABELS), num_clients=4, seed=1)
    dirichlet = partition_indices("dirichlet", data, num_clients=4, seed=1, alpha=0.3)
    assert dirichlet == partition_dirichlet(LABELS, num_clients=4, alpha=0.3, seed=1)
    shards = partition_indices("shards", data, num_clients=4, seed=1, shards_per_client=3)
    assert shards == partition_shards(LABELS, num_clients=4, shards_per_client=3, seed=1)
    allowed = "unknown partition 'labels'; choose one of iid, dirichlet, shards"
    with pytest.raises(ValueError, match=allowed):
        partition_indices("labels", data, num_clients=4, seed=1)
    for alpha in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="alpha .* must be > 0"):
            partition_indices("dirichlet", data, num_clients=4, seed=1, alpha=alpha)
    with pytest.raises(ValueError, match="num_clients must be >= 1"):
        partition_indices("iid", data, num_clients=0, seed=1)
    with pytest.raises(ValueError, match="3 clients need at least 3 items"):
        two = TensorDataset(torch.zeros(2), torch.zeros(2))
        partition_indices("iid", two, num_clients=3, seed=1)


def test_describe_shows_sizes_and_skew():
    parts = partition_shards(LABELS, num_clients=4, shards_per_client=1, seed=0)
    text = describe(parts, LABELS)
    assert "mean label entropy" in text and "of 3.32 bits" in text
    assert len(text.splitlines()) == 1 + 4 + 1
    assert "4 clients, 2000 items" in describe(parts)


# --- the corpus by package --------------------------------------------------------------------

_MARK = re.compile(rb"\n\n# ---- (.+?) ----\n")


def _package_of(rel: str) -> str:
    return rel.split("/")[0] + "/" if "/" in rel else rel


def _files(tokens: torch.Tensor) -> list[str]:
    return [m.decode() for m in _MARK.findall(bytes(tokens.to(torch.uint8).tolist()))]


def test_stdlib_split_keeps_packages_whole_and_the_corpus_validation_out():
    split = corpus_by_package(4, seed=11)
    seen: dict[str, int] = {}
    for client, (tokens, packages) in enumerate(zip(split.tokens, split.packages, strict=True)):
        assert tokens.dtype == torch.long and tokens.dim() == 1 and 0 < tokens.numel()
        found = {_package_of(f) for f in _files(tokens)}
        assert found == set(packages), "the packages reported are the packages read"
        for package in found:
            assert seen.setdefault(package, client) == client, f"{package} split across clients"
    assert not set(seen) & set(split.val_packages)
    assert split.val.numel() > 0
    # the files the corpus holds out for validation are on no client
    val_files = {f for f in _files(load_corpus(DataConfig(max_bytes=300_000)).val)}
    assert val_files and not val_files & set(seen)
    again = corpus_by_package(4, seed=11)
    assert again.packages == split.packages
    assert all(torch.equal(a, b) for a, b in zip(again.tokens, split.tokens, strict=True))
    assert corpus_by_package(4, seed=12).packages != split.packages


def _fake_stdlib(root) -> dict[str, int]:
    sizes = {}
    for i in range(12):
        (root / f"mod{i:02d}.py").write_bytes(b"m" * (1000 + 100 * i))
        sizes[f"mod{i:02d}.py"] = 1000 + 100 * i
    for name, files in (("pkga", 3), ("pkgb", 2), ("big", 4)):
        pkg = root / name
        (pkg / "sub").mkdir(parents=True)
        (pkg / "__init__.py").write_bytes(b"i" * 100)
        for j in range(files):
            (pkg / "sub" / f"f{j}.py").write_bytes(b"p" * 1500)
        (pkg / "tests").mkdir()
        (pkg / "tests" / "test_x.py").write_bytes(b"t" * 9999)  # test directories are left out
        sizes[name + "/"] = 100 + 1500 * files
    (root / "test").mkdir()
    (root / "test" / "__init__.py").write_bytes(b"the regression suite is left out")
    (root / "notapkg").mkdir()
    (root / "notapkg" / "x.py").write_bytes(b"no __init__.py")
    return sizes


def test_fake_library_split_respects_max_bytes_and_balances(tmp_path):
    sizes = _fake_stdlib(tmp_path)
    split = corpus_by_package(3, seed=0, root=str(tmp_path), max_bytes=5000, val_percent=10)
    every = {p for ps in split.packages for p in ps} | set(split.val_packages)
    assert every <= set(sizes) and "test/" not in every and "notapkg/" not in every
    for tokens, packages in zip(split.tokens, split.packages, strict=True):
        text = bytes(tokens.to(torch.uint8).tolist())
        assert b"t" * 100 not in text and b"regression" not in text
        source = len(_MARK.sub(b"", text))
        assert source <= 5000
        assert source == min(5000, sum(min(sizes[p], 5000) for p in packages))
    # a package bigger than max_bytes (big/ holds 6100) is cut, not spread over clients
    owners = [c for c, ps in enumerate(split.packages) if "big/" in ps]
    assert len(owners) <= 1
    loads = [t.numel() for t in split.tokens]
    assert min(loads) > 0.6 * max(loads)
    with pytest.raises(ValueError, match="use fewer clients"):
        corpus_by_package(40, seed=0, root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus_by_package(2, seed=0, root=str(tmp_path / "nope"))
