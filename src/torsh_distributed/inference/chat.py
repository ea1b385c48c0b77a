"""Chat templates: how ``POST /v1/chat/completions`` turns a conversation into one prompt.

A chat model is a language model continuing a transcript in the format it was trained on, so the
template belongs to the model. :class:`ChatTemplate` is that format: ``render`` maps the messages
(``[{"role": ..., "content": ...}, ...]``, roles ``system``, ``developer``, ``user``,
``assistant``, ``tool``, and a ``"name"`` key where the request gave the participant's name) to
the prompt text, which ends where the assistant's answer begins, and
``stop`` lists the strings that end the answer (added to the request's own ``stop``).

The built-in GPT is a byte-level model of Python source with no chat training, so
:data:`PYTHON_COMMENTS` writes the conversation as Python comments, one ``# role: ...`` block
per message (continuation lines ``# ...``; a named participant's block starts
``# user (alice): ...``), followed by ``# assistant:`` and a newline; the model then continues
with code, and an answer ends where it starts a new ``# user:`` or ``# user (...)`` turn::

    # system: You write Python.
    # user: Read a file
    # and count its lines.
    # assistant:

A user model brings its own, e.g. a Hugging Face tokenizer's::

    ChatTemplate(
        render=lambda m: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
        stop=("</s>",),
    )
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ChatTemplate", "PYTHON_COMMENTS", "render_python_comments"]

Messages = Sequence[Mapping[str, str]]


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """How a conversation becomes a prompt for one model (see the module doc)."""

    render: Callable[[Messages], str]
    """``messages -> prompt text`` ending where the assistant's reply starts."""
    stop: tuple[str, ...] = ()
    """Strings that end a reply (e.g. the model's end-of-turn marker)."""


def render_python_comments(messages: Messages) -> str:
    """The conversation as Python comments: ``# role: first line`` (``# role (name): ...`` for
    a named participant) then ``# next line`` per message, then ``# assistant:`` and a newline
    (see the module doc)."""
    out = []
    for message in messages:
        first, *rest = (message.get("content") or "").split("\n")
        who = message["role"] + (f" ({message['name']})" if message.get("name") else "")
        out.append(f"# {who}: {first}".rstrip() + "".join(f"\n# {r}" for r in rest))
    return "\n".join(out) + "\n# assistant:\n"


PYTHON_COMMENTS = ChatTemplate(render=render_python_comments, stop=("\n# user:", "\n# user ("))
"""The built-in GPT's template (module doc)."""
