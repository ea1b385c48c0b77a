"""``--dataset hf:FILE[,seq_len=N][,field=NAME]``: a local text data set, tokenized and packed.

``FILE`` is read through ``datasets`` (``.jsonl`` / ``.json``, ``.parquet``, ``.csv``, ``.txt``;
one record per line for text). The ``field`` column (``text`` by default; a text file's lines
are ``text``) of every record, in file order, is tokenized with the model's tokenizer (no
special tokens added), each document followed by the tokenizer's end-of-sequence token when it
has one, and the stream is cut into consecutive windows of ``seq_len + 1`` tokens (default 128,
at most the model's ``max_position_embeddings``; the tail shorter than a window is dropped).
Item ``i`` is ``(window[:-1], window[1:])``: inputs and next-token targets, no padding.

The packed data set is a pure function of the file, the tokenizer and ``seq_len``: identical on
every rank and at any world size. The engine's sampler draws global batches of window indices
from ``(seed, step)`` (:mod:`torsh_distributed.data.sampler`), so a run is world-size
independent and resumes exactly from a checkpoint's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from torsh_distributed.hf import PREFIX

__all__ = ["BUILDERS", "DatasetSpec", "PackedTokens", "parse_dataset_spec", "load_packed"]

BUILDERS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
}
"""File suffix -> the ``datasets`` builder that reads it."""

DEFAULT_SEQ_LEN = 128


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """A parsed ``hf:FILE[,seq_len=N][,field=NAME]``."""

    path: Path
    seq_len: int | None
    """Tokens per window; ``None`` = ``min(128, max_position_embeddings)``."""
    field: str


def parse_dataset_spec(spec: str, *, what: str = "dataset") -> DatasetSpec:
    """Parse ``hf:FILE[,seq_len=N][,field=NAME]``.

    Raises:
        ValueError: no such file, a suffix ``datasets`` is not asked to read, an unknown or
            malformed option.
    """
    text = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    head, *options = text.split(",")
    path = Path(head).expanduser()
    seq_len: int | None = None
    field = "text"
    for option in options:
        key, sep, value = option.partition("=")
        if key == "seq_len" and sep:
            try:
                seq_len = int(value)
            except ValueError:
                seq_len = 0
            if seq_len < 1:
                raise ValueError(f"--{what} {spec}: seq_len must be a positive integer, got {value!r}")
        elif key == "field" and sep and value:
            field = value
        else:
            raise ValueError(
                f"--{what} {spec}: unknown option {option!r}; options are seq_len=N and field=NAME"
            )
    if not path.is_file():
        raise ValueError(f"--{what} {spec}: no such file {path}")
    if path.suffix.lower() not in BUILDERS:
        raise ValueError(
            f"--{what} {spec}: {path.suffix or 'no suffix'} is not a data file this reads; "
            f"use {', '.join(BUILDERS)}"
        )
    return DatasetSpec(path=path.resolve(), seq_len=seq_len, field=field)


class PackedTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Consecutive windows of a token stream: item ``i`` is
    ``(tokens[i*L : i*L + L], tokens[i*L + 1 : i*L + L + 1])`` for ``L = seq_len``.

    Raises:
        ValueError: ``tokens`` is not 1-D, or holds fewer than ``seq_len + 1`` tokens.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or tokens.numel() < seq_len + 1:
            raise ValueError(
                f"{tokens.numel()} tokens make no window of seq_len {seq_len} (+1 target)"
            )
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"window {index} is out of range for {n} windows")
        start = (index % n) * self.seq_len
        return (
            self.tokens[start : start + self.seq_len],
            self.tokens[start + 1 : start + 1 + self.seq_len],
        )


def _read_texts(spec: DatasetSpec, *, what: str, raw: str) -> list[str]:
    import datasets

    builder = BUILDERS[spec.path.suffix.lower()]
    try:
        table = datasets.load_dataset(builder, data_files=str(spec.path), split="train")
    except Exception as exc:  # noqa: BLE001 - the user's file: report it in one line
        raise ValueError(f"--{what} {raw}: datasets cannot read {spec.path}: {type(exc).__name__}: {exc}") from exc
    if spec.field not in table.column_names:
        raise ValueError(
            f"--{what} {raw}: {spec.path.name} has no column {spec.field!r} (columns: "
            f"{', '.join(table.column_names)}); pick one with ,field=NAME"
        )
    return [str(t) for t in table[spec.field] if t]


def load_packed(
    spec: str, tokenizer: Any, *, max_positions: int | None, vocab_size: int, what: str = "dataset"
) -> PackedTokens:
    """The packed windows of ``spec`` (``hf:FILE[,seq_len=N][,field=NAME]``).

    Args:
        spec: The flag's value.
        tokenizer: The model's tokenizer (a ``transformers`` tokenizer).
        max_positions: The model's ``max_position_embeddings`` (caps the default ``seq_len``,
            and an explicit one larger is refused); ``None`` = no limit.
        vocab_size: The model's vocabulary: a token id at or beyond it is refused.
        what: The flag's name, for messages.

    Raises:
        ValueError: see :func:`parse_dataset_spec`; an unreadable file or missing column; too
            few tokens for one window; a ``seq_len`` above ``max_positions``; token ids outside
            the model's vocabulary (a tokenizer of another model).
    """
    parsed = parse_dataset_spec(spec, what=what)
    seq_len = parsed.seq_len or min(DEFAULT_SEQ_LEN, max_positions or DEFAULT_SEQ_LEN)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(
            f"--{what} {spec}: seq_len {seq_len} exceeds the model's max_position_embeddings "
            f"{max_positions}"
        )
    texts = _read_texts(parsed, what=what, raw=spec)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for doc in ids:
        stream.extend(doc)
        if eos is not None:
            stream.append(int(eos))
    tokens = torch.tensor(stream, dtype=torch.long)
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"--{what} {spec}: the tokenizer gives id {int(tokens.max())}, beyond the model's "
            f"vocab_size {vocab_size}: a tokenizer of another model?"
        )
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"--{what} {spec}: {tokens.numel()} tokens make no window of seq_len {seq_len}"
        )
    return PackedTokens(tokens, seq_len)
