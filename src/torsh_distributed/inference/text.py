"""Text <-> tokens for the built-in byte-level models, and stop-string handling.

The built-in corpus (:mod:`torsh_distributed.data.corpus`) is one token per byte of UTF-8
source, so the built-in GPT's tokenizer is the identity on bytes: :func:`encode_bytes` and
:func:`decode_bytes`. Any other ``encode: str -> list[int]`` / ``decode: list[int] -> str``
pair can be given to :class:`~torsh_distributed.inference.generate.TextGenerator`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["encode_bytes", "decode_bytes", "cut_at_stop"]


def encode_bytes(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as token ids in ``[0, 256)``."""
    return list(text.encode("utf-8"))


def decode_bytes(tokens: Sequence[int]) -> str:
    """Token ids in ``[0, 256)`` as UTF-8 text; invalid sequences (a model can generate any
    byte, or stop inside a multi-byte character) become U+FFFD.

    Raises:
        ValueError: a token outside ``[0, 256)``.
    """
    try:
        data = bytes(tokens)
    except ValueError as exc:
        raise ValueError(f"byte tokens must be in [0, 256): {exc}") from exc
    return data.decode("utf-8", errors="replace")


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to (excluding) the earliest occurrence of any stop string, and whether one
    occurred."""
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)
