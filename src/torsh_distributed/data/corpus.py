"""The built-in corpus (Python's own standard library source) and a deterministic sampler.

Each ``.py`` file directly in the standard library directory is read as bytes, in sorted order,
until ``max_bytes``. A file goes to validation when a hash of its *name* falls below
``val_percent``, so the split does not depend on the order of reading or on ``max_bytes`` (when
a small ``max_bytes`` reads no such file, the last file read is held out instead).

Sampling is a pure function of ``(seed, step)``: the global batch for a step is drawn once and
rank ``r`` of ``n`` takes rows ``[r*B/n, (r+1)*B/n)``. Runs at different world sizes with the
same flags therefore see exactly the same samples per step, which is what makes data-parallel
training comparable to single-process training (and resumable at any step).

:class:`TokenWindows` exposes the same windows as a map-style dataset, so the generic samplers of
:mod:`torsh_distributed.data.sampler` reproduce :func:`sample_batch` exactly.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from torsh_distributed.data.config import DataConfig

__all__ = ["Corpus", "TokenWindows", "load_corpus", "sample_batch"]

_SEPARATOR = b"\n\n# ---- %s ----\n"


@dataclass(frozen=True, slots=True)
class Corpus:
    """Train and validation token streams (one token per byte)."""

    train: torch.Tensor
    """1-D int64 tensor of training tokens."""
    val: torch.Tensor
    """1-D int64 tensor of validation tokens."""
    num_files: int
    """How many source files were read."""
    root: str
    """Directory the files came from."""


def _is_val(name: str, val_percent: int) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < val_percent


def _tokens(parts: list[bytes]) -> torch.Tensor:
    data = b"".join(parts)
    if not data:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def load_corpus(config: DataConfig, *, min_tokens: int = 0) -> Corpus:
    """Read the corpus described by ``config``.

    Args:
        config: Which directory, how many bytes, what validation share.
        min_tokens: Both splits must hold at least this many tokens (a context plus one).

    Raises:
        FileNotFoundError: the directory does not exist or holds no ``.py`` files.
        ValueError: a split is too small for the requested context.
    """
    root = Path(config.root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {root} does not exist (data.root)")
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files in {root} (data.root)")
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = 0
    used = 0
    for path in files:
        if total >= config.max_bytes:
            break
        text = path.read_bytes()[: config.max_bytes - total]
        part = (_SEPARATOR % path.name.encode()) + text
        (val_parts if _is_val(path.name, config.val_percent) else train_parts).append(part)
        total += len(text)
        used += 1
    if not val_parts and len(train_parts) > 1:
        val_parts.append(train_parts.pop())  # too few files for the hash to pick one: hold out the last
    train, val = _tokens(train_parts), _tokens(val_parts)
    for split, tokens in (("train", train), ("validation", val)):
        if tokens.numel() < max(min_tokens, 2):
            raise ValueError(
                f"the {split} split has {tokens.numel()} tokens but needs {min_tokens}; "
                f"raise data.max_bytes (now {config.max_bytes}) or lower model.block_size"
            )
    return Corpus(train=train, val=val, num_files=used, root=str(root))


def sample_batch(
    tokens: torch.Tensor,
    *,
    seed: int,
    step: int,
    batch_size: int,
    block_size: int,
    rank: int = 0,
    num_ranks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch for ``step``: inputs and next-byte targets.

    Args:
        tokens: The token stream to sample from.
        seed: Run seed; with ``step`` it fixes the global batch.
        step: Step index (use distinct ranges for training and evaluation).
        batch_size: Global batch; must be divisible by ``num_ranks``.
        block_size: Sequence length.
        rank: This rank's index among the data-parallel ranks.
        num_ranks: Number of data-parallel ranks.
    """
    if batch_size % num_ranks:
        raise ValueError(f"batch_size {batch_size} is not divisible by {num_ranks} ranks")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - block_size - 1, (batch_size,), generator=gen)
    per_rank = batch_size // num_ranks
    mine = starts[rank * per_rank : (rank + 1) * per_rank]
    offsets = torch.arange(block_size + 1)
    windows = tokens[mine[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of a token stream as a map-style dataset: inputs and next-token targets.

    Item ``i`` is ``(tokens[i : i + block_size], tokens[i + 1 : i + 1 + block_size])`` for
    ``0 <= i < len(tokens) - block_size - 1``, the same range :func:`sample_batch` draws window
    starts from. ``__getitems__`` gathers a whole batch in one indexing operation, so that
    ``fetch(TokenWindows(t, bs), shard(ReplacementSampler(len, global_batch=B, seed=s)
    .indices(step), rank=r, num_ranks=n))`` returns ``[x, y]`` bit-identical to
    ``sample_batch(t, seed=s, step=step, batch_size=B, block_size=bs, rank=r, num_ranks=n)``.

    Items are views of ``tokens`` (no copy until a batch is collated).

    Args:
        tokens: 1-D token stream, e.g. :attr:`Corpus.train`.
        block_size: Sequence length of each item.

    Raises:
        ValueError: ``tokens`` is not 1-D, ``block_size`` < 1, or ``tokens`` holds fewer than
            ``block_size + 2`` tokens (no window).
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if tokens.numel() < block_size + 2:
            raise ValueError(
                f"tokens holds {tokens.numel()} tokens but block_size {block_size} needs at "
                f"least {block_size + 2}"
            )
        self.tokens = tokens
        self.block_size = block_size
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return self.tokens.numel() - self.block_size - 1

    def _starts(self, indices: torch.Tensor) -> torch.Tensor:
        n = len(self)
        if indices.numel() and not bool(((indices >= -n) & (indices < n)).all()):
            bad = indices[(indices < -n) | (indices >= n)][0].item()
            raise IndexError(f"index {bad} is out of range for {n} windows")
        return torch.where(indices < 0, indices + n, indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self._starts(torch.tensor([index]))[0])
        return (
            self.tokens[start : start + self.block_size],
            self.tokens[start + 1 : start + 1 + self.block_size],
        )

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Items ``indices`` in one vectorised gather (torch's batched-fetch protocol)."""
        starts = self._starts(torch.as_tensor(indices, dtype=torch.long))
        windows = self.tokens[starts[:, None] + self._offsets]
        inputs, targets = windows[:, :-1], windows[:, 1:]
        return list(zip(inputs, targets, strict=True))
