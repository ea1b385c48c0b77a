"""The files behind batch inference (private): the JSONL input, the per-rank part files that make
a run resumable, and the final output written whole.

* **Input.** One JSON object per line with a ``prompt`` and optional per-line settings
  (:data:`OVERRIDES`) and ``id``; blank lines are skipped. Errors name the file and line.
* **Keys.** Every prompt gets a key: the SHA-256 of its index, its parsed line, the sampling
  settings it will run with (its seed included) and the checkpoint. A result in a part file
  counts as done only under the same key, so a changed line, setting or model is recomputed,
  never mixed in.
* **Seeds.** A line without its own ``seed`` samples with :func:`prompt_seed` of the run's seed
  and its index: a prompt's tokens depend on neither the number of ranks nor its batch.
* **Part files.** Each rank appends finished results to ``<output>.parts/rank_<R>.jsonl``, one
  complete line per result, flushed and fsync'ed per batch. A line without its newline (a rank
  killed mid-write) is ignored and cut off before that rank appends again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torsh_distributed.inference.sampling import SamplingConfig

__all__ = [
    "OVERRIDES",
    "PromptItem",
    "read_prompts",
    "prompt_seed",
    "parts_dir",
    "scan_parts",
    "PartWriter",
    "write_jsonl_atomic",
]

OVERRIDES: dict[str, str] = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop_strings",
}
"""Per-line settings (JSON key -> :class:`SamplingConfig` field); ``stop`` is a list of strings."""
_KNOWN = {"prompt", "id", *OVERRIDES}


@dataclass(frozen=True, slots=True)
class PromptItem:
    """One prompt of the input, with the settings it runs with."""

    index: int
    """Position among the input's prompts (0-based; blank lines do not count)."""
    line: int
    """Line number in the input file (1-based), for error messages."""
    prompt: str
    """The prompt text."""
    id: Any
    """The line's ``id`` (any JSON value), or ``None``."""
    sampling: SamplingConfig
    """The run's settings with the line's overrides and the prompt's seed."""
    key: str
    """Hex SHA-256 identifying this prompt's result (see the module doc)."""


def prompt_seed(seed: int, index: int) -> int:
    """The seed of the prompt at ``index`` in a run seeded with ``seed``: the first 8 bytes of
    ``sha256(f"{seed}:{index}")``, little-endian (distinct streams per prompt, the same whatever
    rank or batch computes it)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _overrides(obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field_name in OVERRIDES.items():
        if key not in obj:
            continue
        value = obj[key]
        if key == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list):
                raise ValueError(f"{where}: 'stop' must be a string or a list of strings")
            value = tuple(value)
        out[field_name] = value
    return out


def read_prompts(
    path: str | Path,
    base: SamplingConfig,
    *,
    checkpoint: str,
    count_tokens: Callable[[str], int],
    max_seq_len: int | None,
) -> list[PromptItem]:
    """Parse and validate the JSONL input.

    Args:
        path: The input file.
        base: The run's sampling settings; a line's own settings replace these fields.
        checkpoint: Identifies the model in every key (a resolved step directory).
        count_tokens: ``prompt -> number of tokens`` (the tokenizer's length).
        max_seq_len: The model's context; a longer prompt is an error. ``None``: no limit.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object, without a non-empty string ``prompt``,
            with a bad setting, or a prompt longer than the context (``FILE:LINE: why``); an
            input without any prompt.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such input file: {path}")
    items: list[PromptItem] = []
    unknown: set[str] = set()
    with open(path, encoding="utf-8") as fp:
        for number, text in enumerate(fp, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(
                    f'{where}: each line must be a JSON object like {{"prompt": "..."}}, got '
                    f"{type(obj).__name__}"
                )
            prompt = obj.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: needs a non-empty string 'prompt'")
            unknown.update(set(obj) - _KNOWN)
            index = len(items)
            fields = _overrides(obj, where)
            fields.setdefault("seed", prompt_seed(base.seed, index))
            try:
                sampling = dataclasses.replace(base, **fields)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where}: {exc}") from None
            length = count_tokens(prompt)
            if max_seq_len is not None and length > max_seq_len:
                raise ValueError(
                    f"{where}: the prompt has {length} tokens, more than the model's context "
                    f"of {max_seq_len}"
                )
            key = _key(index, obj, sampling, checkpoint)
            items.append(
                PromptItem(
                    index=index,
                    line=number,
                    prompt=prompt,
                    id=obj.get("id"),
                    sampling=sampling,
                    key=key,
                )
            )
    if not items:
        raise ValueError(f"{path} holds no prompts (one JSON object per line with a 'prompt')")
    if unknown:
        warnings.warn(
            f"{path}: fields {', '.join(sorted(unknown))} are not used (known: "
            f"{', '.join(sorted(_KNOWN))})",
            stacklevel=2,
        )
    return items


def _key(index: int, obj: Mapping[str, Any], sampling: SamplingConfig, checkpoint: str) -> str:
    record = {
        "index": index,
        "line": obj,
        "sampling": dataclasses.asdict(sampling),
        "checkpoint": checkpoint,
    }
    text = json.dumps(record, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def parts_dir(output: str | Path) -> Path:
    """Where the ranks of a run writing ``output`` keep their part files."""
    output = Path(output)
    return output.with_name(output.name + ".parts")


def _complete_lines(path: Path) -> Iterable[bytes]:
    data = path.read_bytes()
    end = data.rfind(b"\n")
    return data[: end + 1].splitlines() if end >= 0 else []


def scan_parts(directory: Path, keys: Mapping[int, str]) -> dict[int, dict[str, Any]]:
    """The finished results in ``directory``'s part files whose key matches ``keys[index]``
    (any rank's file: results do not depend on the rank count). Torn or unreadable lines are
    skipped; results under another key (a changed input or setting) are ignored with a warning."""
    done: dict[int, dict[str, Any]] = {}
    stale = 0
    for part in sorted(directory.glob("rank_*.jsonl")) if directory.is_dir() else []:
        for raw in _complete_lines(part):
            try:
                record = json.loads(raw)
                index, key = int(record["index"]), str(record["key"])
            except (ValueError, KeyError, TypeError):
                continue
            if keys.get(index) == key:
                done[index] = record
            else:
                stale += 1
    if stale:
        warnings.warn(
            f"{stale} earlier result(s) in {directory} were computed from a different input line, "
            "setting or checkpoint: ignored, recomputed",
            stacklevel=2,
        )
    return done


class PartWriter:
    """Appends one rank's results to ``rank_<R>.jsonl`` (a torn last line is cut off first)."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank_{rank}.jsonl"
        if self.path.exists():
            data = self.path.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep != len(data):
                with open(self.path, "r+b") as fp:
                    fp.truncate(keep)

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Write ``records`` as lines, flushed and fsync'ed: after this they survive a crash."""
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with open(self.path, "a", encoding="utf-8") as fp:
            fp.write(text)
            fp.flush()
            os.fsync(fp.fileno())


def write_jsonl_atomic(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Write ``records`` as JSON lines through a temporary file, fsync and a rename: the file
    either does not exist (or keeps its old content) or holds every line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fp:
        for record in records:
            fp.write(json.dumps(record, ensure_ascii=False) + "\n")
        fp.flush()
        os.fsync(fp.fileno())
    os.replace(tmp, path)
