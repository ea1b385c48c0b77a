"""Rank 0's progress bar and the end-of-run summary table."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

from tqdm import tqdm

__all__ = ["Progress", "format_summary"]


class _LineStream:
    """Turns tqdm's carriage-return redraws into whole lines.

    Under ``torsh-dist run`` a rank's stdout is a pipe that the launcher prefixes line by line;
    redraws with ``\r`` would pile up on one prefixed line, so each redraw becomes a line.
    """

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._buffer = ""

    def write(self, text: str) -> int:
        for char in text:
            if char in "\r\n":
                self._emit()
            else:
                self._buffer += char
        return len(text)

    def _emit(self) -> None:
        if self._buffer.strip():
            self._out.write(self._buffer.rstrip() + "\n")
        self._buffer = ""

    def flush(self) -> None:
        self._out.flush()

    def close(self) -> None:
        self._emit()
        self.flush()


class Progress:
    """A tqdm bar that exists only where ``enabled`` (rank 0); a no-op elsewhere.

    On a terminal the bar redraws in place; otherwise (a pipe, a log file, the launcher) every
    refresh is printed as one line, at most every ``mininterval`` seconds.
    """

    def __init__(
        self, *, total: int, enabled: bool, desc: str, out: TextIO | None = None, unit: str = "step"
    ) -> None:
        out = out or sys.stdout
        self._stream: _LineStream | None = None
        if enabled and not out.isatty():
            self._stream = _LineStream(out)
        self._bar = (
            tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True,
                 file=self._stream or out, mininterval=0.5 if self._stream is None else 2.0,
                 leave=True, ascii=self._stream is not None)
            if enabled
            else None
        )
        self._enabled = enabled

    def update_to(self, step: int, **postfix: float) -> None:
        if self._bar is None:
            return
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._stream or sys.stdout)
        elif self._enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._stream is not None:
            self._stream.close()


def _fmt(value: float | int | str) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


_LABELS = {
    "steps": "steps",
    "initial_loss": "initial train loss",
    "final_loss": "final train loss (last 10)",
    "val_loss": "validation loss",
    "samples_per_s": "samples/s (all ranks)",
    "tokens_per_s": "tokens/s (all ranks)",
    "world_size": "world size",
    "backend": "backend",
    "num_params": "parameters",
    "wall_time_s": "wall time (s)",
}


_JSON_ONLY = frozenset({"first_step_unix_s"})  # a timestamp: for tools reading --summary-json


def _flatten(summary: Mapping[str, object], prefix: str = "") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, value in summary.items():
        label = _LABELS.get(key, key) if not prefix else f"{prefix} {key.replace('_', ' ')}"
        if isinstance(value, Mapping):
            rows.extend(_flatten(value, label))
        elif isinstance(value, (int, float, str)):
            rows.append((label, _fmt(value)))
    return rows


def format_summary(summary: Mapping[str, object]) -> str:
    """A two-column table of the summary fields, known ones first and labelled.

    Nested sections (``{"compression": {"ratio": 4.0}}``) become rows such as
    ``compression ratio``; lists are left to the JSON summary.
    """
    rows = _flatten({k: v for k, v in summary.items() if k not in _JSON_ONLY})
    order = list(_LABELS.values())
    rows.sort(key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    width = max(len(k) for k, _ in rows)
    value_width = max(len(v) for _, v in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (value_width + 2) + "+"
    body = [f"| {k:<{width}} | {v:>{value_width}} |" for k, v in rows]
    return "\n".join([line, f"| {'summary':<{width}} | {'':>{value_width}} |", line, *body, line])
