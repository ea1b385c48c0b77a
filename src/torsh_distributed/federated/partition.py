"""Splitting data among federated clients: IID, Dirichlet label skew, label shards, and the
built-in corpus by standard-library package.

Every partitioner is a pure function of its inputs and ``seed``: a client process on any host
rebuilds exactly its own share from the same flags, without a file or a message.

* :func:`partition_iid`: a seeded permutation cut into equal parts (sizes differ by at most 1).
* :func:`partition_dirichlet`: for each class, the share of each client is drawn from
  ``Dir(alpha)`` (Hsu et al. 2019, "Measuring the effects of non-identical data distribution";
  the per-class draw of Flower Datasets' ``DirichletPartitioner``). Small ``alpha`` (0.1) gives
  each client few labels; large ``alpha`` (100) approaches IID.
* :func:`partition_shards`: sort by label, cut into ``num_clients * shards_per_client`` shards,
  deal each client ``shards_per_client`` of them (McMahan et al. 2017, the pathological
  non-IID MNIST split).
* :func:`corpus_by_package`: the natural non-IID split of the built-in corpus, whole packages
  per client (as LEAF splits Shakespeare by role).

The index partitioners use NumPy only; torch is imported by the functions that return tensors.
"""

from __future__ import annotations

import math
import os
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "KINDS",
    "PackageSplit",
    "corpus_by_package",
    "dataset_labels",
    "describe",
    "label_entropy",
    "partition_dirichlet",
    "partition_iid",
    "partition_indices",
    "partition_shards",
]

KINDS = ("iid", "dirichlet", "shards")
"""The kinds :func:`partition_indices` dispatches (the corpus's ``package`` split is separate)."""

DEFAULT_MAX_BYTES = 240_000
"""Default bytes of source per client in :func:`corpus_by_package` (a few seconds of training)."""

_MAX_DIRICHLET_TRIES = 100
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__"})


# --- validation -------------------------------------------------------------------------------


def _check_clients(num_clients: int, num_items: int, *, min_size: int = 1) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_items < num_clients * min_size:
        raise ValueError(
            f"{num_clients} clients need at least {num_clients * min_size} items "
            f"({min_size} each) but the dataset has {num_items}; use fewer clients"
        )


def _check_alpha(alpha: float) -> None:
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha (Dirichlet concentration) must be > 0, got {alpha}")


def _labels_array(labels: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(
            f"labels must be a 1-D sequence of integer class labels, got shape {arr.shape} "
            f"dtype {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)


def _sorted_lists(parts: Sequence[np.ndarray]) -> list[list[int]]:
    return [np.sort(p).tolist() for p in parts]


# --- index partitioners -----------------------------------------------------------------------


def partition_iid(num_items: int, *, num_clients: int, seed: int) -> list[list[int]]:
    """Equal-size random split of ``range(num_items)``.

    Args:
        num_items: Size of the dataset.
        num_clients: Number of parts; sizes differ by at most one item.
        seed: Fixes the permutation.

    Returns:
        Each client's indices, ascending.

    Raises:
        ValueError: ``num_clients`` < 1 or more clients than items.
    """
    _check_clients(num_clients, num_items)
    order = np.random.default_rng(seed).permutation(num_items)
    return _sorted_lists(np.array_split(order, num_clients))


def partition_dirichlet(
    labels: Sequence[int] | np.ndarray,
    *,
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 1,
) -> list[list[int]]:
    """Label-skewed split: each class is divided among clients by proportions ``~ Dir(alpha)``.

    For every class ``k`` (ascending) its indices are shuffled and cut at the cumulative
    proportions of a fresh draw ``p ~ Dir(alpha * 1)`` over clients. The whole draw is repeated
    (from the same generator, so still deterministic) until every client holds at least
    ``min_size`` items, at most 100 times.

    Args:
        labels: Class label of each item.
        num_clients: Number of parts.
        alpha: Concentration: small = few labels per client and very unequal sizes; large =
            close to IID. Very small ``alpha`` with many clients often leaves a client empty,
            hence ``min_size`` and the retries.
        seed: Fixes every draw.
        min_size: Fewest items a client may get (>= 1, so that every client can train).

    Returns:
        Each client's indices, ascending.

    Raises:
        ValueError: ``alpha`` <= 0, ``num_clients`` < 1, ``min_size`` < 1, fewer items than
            ``num_clients * min_size``, or no draw in 100 gave every client ``min_size`` items.
    """
    _check_alpha(alpha)
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    arr = _labels_array(labels)
    _check_clients(num_clients, arr.size, min_size=min_size)
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(arr == k) for k in np.unique(arr)]
    smallest = 0
    for _ in range(_MAX_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(proportions)[:-1] * idx.size).astype(np.int64)
            for client, piece in enumerate(np.split(idx, cuts)):
                parts[client].append(piece)
        merged = [np.concatenate(p) for p in parts]
        smallest = min(m.size for m in merged)
        if smallest >= min_size:
            return _sorted_lists(merged)
    raise ValueError(
        f"Dirichlet split with alpha={alpha} left a client with {smallest} items after "
        f"{_MAX_DIRICHLET_TRIES} draws, below min_size={min_size}: raise alpha, lower min_size "
        f"or use fewer than {num_clients} clients"
    )


def partition_shards(
    labels: Sequence[int] | np.ndarray,
    *,
    num_clients: int,
    shards_per_client: int = 2,
    seed: int,
) -> list[list[int]]:
    """Pathological label skew: each client gets ``shards_per_client`` contiguous label shards.

    The items are shuffled (seeded) and stably sorted by label, cut into
    ``num_clients * shards_per_client`` shards of equal size (+-1), and the shards are dealt out
    in a seeded random order. A shard spans at most two labels when every class holds at least
    one shard's worth of items, so a client then sees at most ``2 * shards_per_client`` labels
    (usually ``shards_per_client``).

    Args:
        labels: Class label of each item.
        num_clients: Number of parts.
        shards_per_client: Shards per client: 1 or 2 = nearly one or two labels per client
            (McMahan et al. use 2 on MNIST); more = milder skew.
        seed: Fixes the within-class order and the dealing.

    Returns:
        Each client's indices, ascending.

    Raises:
        ValueError: ``num_clients`` or ``shards_per_client`` < 1, or fewer items than shards.
    """
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be >= 1, got {shards_per_client}")
    arr = _labels_array(labels)
    _check_clients(num_clients, arr.size, min_size=shards_per_client)
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(arr.size)
    order = shuffled[np.argsort(arr[shuffled], kind="stable")]
    shards = np.array_split(order, num_clients * shards_per_client)
    dealt = rng.permutation(len(shards)).reshape(num_clients, shards_per_client)
    return _sorted_lists([np.concatenate([shards[s] for s in row]) for row in dealt])


# --- labels of a dataset ----------------------------------------------------------------------


def _as_label_array(values: Any) -> np.ndarray | None:
    """``values`` as a 1-D integer array, or ``None`` when it is not one."""
    if hasattr(values, "detach"):
        values = values.detach().cpu()
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError):
        return None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        return None
    return arr.astype(np.int64, copy=False)


def _scalar_label(target: Any, index: int) -> int:
    if hasattr(target, "detach"):
        target = target.detach().cpu()
    arr = np.asarray(target)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"item {index}'s target (shape {tuple(arr.shape)}, dtype {arr.dtype}) is not a scalar "
            "class label: the dirichlet and shards partitioners split by label; use the iid "
            "partitioner (--partition iid) for sequences, regression or token targets"
        )
    return int(arr)


def dataset_labels(dataset: Any) -> list[int]:
    """The class label of every item of a map-style dataset of ``(input, target)`` items.

    Fast paths, in order: a ``targets`` or ``labels`` attribute of the dataset's length
    (torchvision's datasets), a ``TensorDataset`` of two tensors (its second tensor), and a
    ``Subset`` (its indices into the parent's labels). Otherwise every item is read, which
    costs one ``__getitem__`` per item.

    Args:
        dataset: Supports ``len()`` and ``dataset[i]`` returning ``(input, target)``, ``target``
            an ``int``, a NumPy integer or a 0-d integer tensor.

    Raises:
        ValueError: a target is not a scalar integer (e.g. the next-token targets of the
            built-in corpus, or floats): the message names the fix, the iid partitioner.
    """
    n = len(dataset)
    for name in ("targets", "labels"):
        found = getattr(dataset, name, None)
        if found is not None and not callable(found):
            arr = _as_label_array(found)
            if arr is not None and arr.size == n:
                return arr.tolist()
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:
        arr = _as_label_array(tensors[1])
        if arr is not None and arr.size == n:
            return arr.tolist()
    parent, indices = getattr(dataset, "dataset", None), getattr(dataset, "indices", None)
    if parent is not None and indices is not None:
        base = dataset_labels(parent)
        return [base[int(i)] for i in indices]
    labels = []
    for i in range(n):
        item = dataset[i]
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise ValueError(
                f"item {i} is a {type(item).__name__}, not an (input, target) pair: cannot read "
                "class labels; use the iid partitioner (--partition iid)"
            )
        labels.append(_scalar_label(item[1], i))
    return labels


# --- the dispatcher ---------------------------------------------------------------------------


def partition_indices(
    kind: str,
    dataset: Any,
    *,
    num_clients: int,
    seed: int,
    alpha: float = 0.5,
    shards_per_client: int = 2,
    min_size: int = 1,
) -> list[list[int]]:
    """Split any map-style dataset among ``num_clients`` clients.

    Args:
        kind: ``iid`` (needs only ``len(dataset)``), ``dirichlet`` or ``shards`` (read the
            labels with :func:`dataset_labels`).
        dataset: The training set.
        num_clients: Number of clients.
        seed: Fixes the split.
        alpha: Dirichlet concentration (``dirichlet`` only; validated for every kind).
        shards_per_client: Shards per client (``shards`` only).
        min_size: Fewest items per client (``dirichlet`` only; the others give every client at
            least one item or fail).

    Returns:
        Each client's indices into ``dataset``, ascending; together they cover every item once.

    Raises:
        ValueError: unknown ``kind`` (the message lists the allowed ones), ``alpha`` <= 0,
            ``num_clients`` < 1, more clients than items, or targets that are not class labels.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown partition {kind!r}; choose one of {', '.join(KINDS)}")
    _check_alpha(alpha)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if kind == "iid":
        return partition_iid(len(dataset), num_clients=num_clients, seed=seed)
    labels = dataset_labels(dataset)
    if kind == "dirichlet":
        return partition_dirichlet(
            labels, num_clients=num_clients, alpha=alpha, seed=seed, min_size=min_size
        )
    return partition_shards(
        labels, num_clients=num_clients, shards_per_client=shards_per_client, seed=seed
    )


# --- statistics -------------------------------------------------------------------------------


def label_entropy(indices: Sequence[int], labels: Sequence[int] | np.ndarray) -> float:
    """Shannon entropy in bits of the label histogram of ``indices`` (0 for one label or none)."""
    arr = _labels_array(labels)[np.asarray(indices, dtype=np.int64)]
    if arr.size == 0:
        return 0.0
    p = np.unique(arr, return_counts=True)[1] / arr.size
    return float(-(p * np.log2(p)).sum())


def describe(
    parts: Sequence[Sequence[int]], labels: Sequence[int] | np.ndarray | None = None
) -> str:
    """A small table of a split: per client its size and, with ``labels``, the number of
    distinct labels, the most common label's share and the label entropy; then a summary line.

    Args:
        parts: Each client's indices.
        labels: Class labels of the whole dataset (``None``: sizes only).
    """
    sizes = [len(p) for p in parts]
    if labels is None:
        lines = ["client  items"] + [f"{c:>6}  {n:>5}" for c, n in enumerate(sizes)]
        return "\n".join(lines + [f"{len(parts)} clients, {sum(sizes)} items, "
                                  f"min {min(sizes, default=0)} max {max(sizes, default=0)}"])
    arr = _labels_array(labels)
    lines = ["client  items  labels  top share  entropy (bits)"]
    entropies = []
    for c, p in enumerate(parts):
        sub = arr[np.asarray(p, dtype=np.int64)]
        counts = np.unique(sub, return_counts=True)[1] if sub.size else np.zeros(0, np.int64)
        top = counts.max() / sub.size if sub.size else 0.0
        entropies.append(label_entropy(p, arr))
        lines.append(
            f"{c:>6}  {sub.size:>5}  {counts.size:>6}  {top:>9.2f}  {entropies[-1]:>14.2f}"
        )
    num_labels = np.unique(arr).size
    top_bits = math.log2(num_labels) if num_labels > 1 else 0.0
    lines.append(
        f"{len(parts)} clients, {sum(sizes)} items, {num_labels} labels; mean label entropy "
        f"{np.mean(entropies) if entropies else 0.0:.2f} of {top_bits:.2f} bits (IID)"
    )
    return "\n".join(lines)


# --- the built-in corpus by package -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PackageSplit:
    """The built-in corpus dealt to clients by whole package."""

    tokens: list[torch.Tensor]
    """Each client's 1-D int64 token stream (one token per byte)."""
    packages: list[list[str]]
    """Each client's packages, sorted: ``json/`` for a package directory, ``argparse.py`` for a
    top-level module."""
    val: torch.Tensor
    """Tokens of the held-out packages (at most ``max_bytes``): no client trains on them."""
    val_packages: list[str]
    """The held-out packages (all of them; ``val`` reads them in this order up to ``max_bytes``)."""
    root: str
    """Directory the source came from."""


@dataclass(frozen=True, slots=True)
class _Package:
    name: str
    files: list[tuple[str, Path, int]]  # (path relative to root, path, size in bytes)

    @property
    def size(self) -> int:
        return sum(size for _, _, size in self.files)


def _package_files(root: Path, directory: Path) -> list[tuple[str, Path, int]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path, path.stat().st_size))
    return sorted(found)


def _packages(root: Path) -> list[_Package]:
    """Top-level modules and package directories (with ``__init__.py``) under ``root``, sorted
    by name; the regression test suite (``test/``) and test directories inside packages are
    left out."""
    found = []
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix == ".py":
            found.append(_Package(entry.name, [(entry.name, entry, entry.stat().st_size)]))
        elif (
            entry.is_dir()
            and entry.name not in _SKIPPED_DIRS
            and (entry / "__init__.py").is_file()
        ):
            files = _package_files(root, entry)
            if files:
                found.append(_Package(entry.name + "/", files))
    return sorted(found, key=lambda p: p.name)


def _read(packages: Sequence[_Package], *, per_package: int, total: int) -> list[bytes]:
    """The separator-prefixed bytes of ``packages``' files in order: at most ``per_package``
    bytes of source from each package and ``total`` in all, cut as
    :func:`~torsh_distributed.data.corpus.load_corpus` cuts the corpus (the last file read is
    truncated; separators are not counted)."""
    from torsh_distributed.data.corpus import _SEPARATOR

    parts = []
    for package in packages:
        left = min(per_package, total)
        for rel, path, _ in package.files:
            if left <= 0:
                break
            text = path.read_bytes()[:left]
            parts.append((_SEPARATOR % rel.encode()) + text)
            left -= len(text)
            total -= len(text)
    return parts


def corpus_by_package(
    num_clients: int,
    *,
    seed: int,
    root: str = "",
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_percent: int = 5,
) -> PackageSplit:
    """The built-in corpus split by standard-library package: each client a set of whole packages.

    A *package* is a top-level module (``argparse.py``) or a package directory with all its
    ``.py`` files (``json/``, ``email/``, ``asyncio/``; test directories and the ``test/``
    suite excluded). Files are read as bytes with the corpus's separator line before each, in
    sorted path order, one token per byte, exactly as
    :func:`~torsh_distributed.data.corpus.load_corpus` reads top-level files.

    Held-out data: a package is held out when the corpus's hash of its name falls below
    ``val_percent``. For top-level modules this is the very rule (and name) of ``load_corpus``,
    so the files of the corpus's validation split (``load_corpus(...).val`` with the same
    ``val_percent``) are never on a client, and the server may evaluate on either. When no
    package hashes into the held-out share, the last package by name is held out instead.

    Dealing: a package bigger than ``max_bytes`` is cut at ``max_bytes`` (its first files in
    path order), so it may fill one client alone. The seed fixes which packages are dealt: the
    other packages are visited in a seeded random order and taken while their bytes fit the
    clients' capacity (``num_clients * max_bytes``). They are dealt greedily, largest first
    (ties in the seeded order), each to the client with the fewest bytes so far (lowest index
    on ties) among those it still fits under ``max_bytes``; then the packages not taken fill any
    room left, in the seeded order. Every client thus holds whole packages no other client has,
    at least one, and bytes are balanced: each client gets close to ``max_bytes`` when the
    library is large enough, otherwise the library is spread evenly.

    Args:
        num_clients: Number of clients.
        seed: Fixes which packages each client gets.
        root: Directory to read; empty = this Python's standard library.
        max_bytes: Most bytes of source per client (and of ``val``): bigger = more data per
            client, slower rounds. The default keeps a round to seconds.
        val_percent: Percent of packages held out (the corpus's ``data.val_percent``).

    Raises:
        FileNotFoundError: ``root`` does not exist or holds no package.
        ValueError: ``num_clients`` or ``max_bytes`` < 1, ``val_percent`` outside (0, 100), or
            fewer packages than clients.
    """
    from torsh_distributed.data.corpus import _is_val, _tokens

    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent must be in (0, 100), got {val_percent}")
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"corpus directory {base} does not exist")
    every = _packages(base)
    if not every:
        raise FileNotFoundError(f"no .py modules or packages in {base}")
    held = [p for p in every if _is_val(p.name, val_percent)]
    train = [p for p in every if not _is_val(p.name, val_percent)]
    if not held and len(train) > 1:
        held.append(train.pop())
    if len(train) < num_clients:
        raise ValueError(
            f"{num_clients} clients need a package each but {base} has {len(train)} training "
            "packages; use fewer clients"
        )

    order = list(train)
    random.Random(seed).shuffle(order)
    size = {p.name: min(p.size, max_bytes) for p in order}
    # Which packages: the seeded order up to the clients' capacity; then who gets them: largest
    # first to the least-loaded client (LPT, for balance); then the rest fill what room is left.
    selected, skipped, total = [], [], 0
    for package in order:
        fits = total + size[package.name] <= num_clients * max_bytes
        (selected if fits else skipped).append(package)
        total += size[package.name] if fits else 0
    selected.sort(key=lambda p: -size[p.name])  # stable: the seeded order breaks ties
    loads = [0] * num_clients
    chosen: list[list[_Package]] = [[] for _ in range(num_clients)]
    for package in selected + skipped:
        room = [c for c in range(num_clients) if loads[c] + size[package.name] <= max_bytes]
        if room:
            client = min(room, key=lambda c: (loads[c], c))
            chosen[client].append(package)
            loads[client] += size[package.name]
    assert all(chosen), "an empty client always fits a package cut at max_bytes"

    tokens = []
    for packages in chosen:
        packages.sort(key=lambda p: p.name)
        tokens.append(_tokens(_read(packages, per_package=max_bytes, total=max_bytes)))
    return PackageSplit(
        tokens=tokens,
        packages=[[p.name for p in packages] for packages in chosen],
        val=_tokens(_read(held, per_package=max_bytes, total=max_bytes)),
        val_packages=[p.name for p in held],
        root=str(base),
    )
