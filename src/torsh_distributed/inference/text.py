"""Text <-> tokens for the built-in byte-level models, stop-string handling, and the release of
streamed text (:class:`TextStream`).

The built-in corpus (:mod:`torsh_distributed.data.corpus`) is one token per byte of UTF-8
source, so the built-in GPT's tokenizer is the identity on bytes: :func:`encode_bytes` and
:func:`decode_bytes`. Any other ``encode: str -> list[int]`` / ``decode: list[int] -> str``
pair can be given to :class:`~torsh_distributed.inference.generate.TextGenerator`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["encode_bytes", "decode_bytes", "cut_at_stop", "TextStream"]


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


class TextStream:
    """The text of one streamed choice, released as it becomes final.

    Byte-level tokens can end inside a UTF-8 character, and a stop string's first characters
    may already be generated when it completes, so the tail that may still change (trailing
    U+FFFD, the last ``len(longest stop) - 1`` characters) is held back until the next token or
    the end; the concatenated deltas equal the non-streamed ``text``.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        *,
        stop_strings: Sequence[str] = (),
        stop_tokens: Sequence[int] = (),
    ) -> None:
        self._decode = decode
        self._stops = tuple(stop_strings)
        self._stop_tokens = set(stop_tokens)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        """Add a generated token; the text that became final (maybe ``""``)."""
        self.tokens.append(token)
        body = self.tokens[:-1] if token in self._stop_tokens else self.tokens
        text, found = cut_at_stop(self._decode(body), self._stops)
        end = len(text) if found else len(text) - self._hold
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        if end <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) : end], text[:end]
        return delta

    def finish(self, final: str) -> str:
        """The rest of the final ``text`` not yet sent."""
        delta = final[len(self.sent) :] if final.startswith(self.sent) else final
        self.sent = final
        return delta
