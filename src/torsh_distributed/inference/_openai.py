"""The OpenAI API's request and response shapes (private): the request models that validate
``POST /v1/completions`` and ``POST /v1/chat/completions`` bodies, their translation into rows to
decode, and the JSON of answers, stream chunks and errors.

Request fields follow OpenAI's reference and vLLM's extras: what we implement is honoured
(``model``, ``prompt``/``messages``, ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``,
``seed``, ``stream``, ``stream_options.include_usage``, ``logprobs`` / ``top_logprobs``,
``user`` (ignored), vLLM's ``top_k`` and ``return_token_ids``); a field that asks for a
behaviour we do not implement (``echo``, penalties, ``logit_bias``, ``best_of != n``,
``suffix``, tools) is refused with 400
naming it, unless it carries its neutral value: a setting is never dropped silently. Unknown
fields are refused (a typo such as ``temprature`` would otherwise sample at the default).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from torsh_distributed.inference.chat import ChatTemplate
from torsh_distributed.inference.generate import GenerationResult
from torsh_distributed.inference.sampling import SamplingConfig

__all__ = [
    "APIError",
    "CompletionRequest",
    "ChatCompletionRequest",
    "Choice",
    "Plan",
    "Limits",
    "parse",
    "plan_completion",
    "plan_chat",
    "error_body",
    "finish_reason",
]

_SEEDS = 2**64
_MAX_STOPS = 16


class APIError(Exception):
    """A request the server refuses: HTTP status, message, and OpenAI's ``param`` / ``code``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    """A last chunk with ``usage`` and no choices before ``[DONE]``."""
    continuous_usage_stats: bool | None = None  # vLLM's; accepted, not implemented when true


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str | None = None
    """The served model's id (``GET /v1/models``); another id is 404. ``None``: ours."""
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1)
    """vLLM's extra: sample among the k most likely tokens; -1 or 0 = off."""
    n: StrictInt = Field(1, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=_SEEDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and ignored (OpenAI uses it for abuse monitoring)."""
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    """vLLM's extra: each choice carries its ``token_ids``, the answer ``prompt_token_ids``."""


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    """Report each token's log-probability and this many alternatives' (OpenAI's limit: 5)."""
    echo: bool = False
    best_of: StrictInt | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "messages": 'a non-empty list of {"role", "content"} objects',
    "max_tokens": "an int >= 1",
    "max_completion_tokens": "an int >= 1",
    "temperature": "a finite number >= 0 (0 = greedy)",
    "top_p": "a number in (0, 1]",
    "top_k": "an int >= -1 (-1 or 0 = off)",
    "n": "an int >= 1",
    "stop": "a string or a list of strings",
    "seed": "an int in [-2**63, 2**64)",
    "stream": "true or false",
    "logprobs": "null or an int in [0, 5] (completions), true or false (chat)",
    "top_logprobs": "an int in [0, 20]",
}


def parse(model: type[_Strict], body: bytes) -> Any:
    """``body`` validated by ``model``, or :class:`APIError` (400) naming the field at fault."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        kind, loc = error["type"], [str(p) for p in error["loc"]]
        if kind == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {error['msg']}") from None
        if not loc:
            raise APIError(400, f"the body must be a JSON object: {error['msg']}") from None
        param = loc[0]
        if kind == "extra_forbidden":
            message = f"unknown field: {'.'.join(loc)}"
        elif kind == "missing":
            message = f"missing field: {'.'.join(loc)}"
        elif param in _EXPECTED and len(loc) <= 2:
            shown = json.dumps(error.get("input"))[:80] if "input" in error else "?"
            message = f"{param} must be {_EXPECTED[param]}, got {shown}"
        else:
            message = f"{'.'.join(loc)}: {error['msg']}"
        raise APIError(400, message, param=param) from None


def _unsupported(name: str, why: str = "is not supported by this server") -> APIError:
    return APIError(400, f"{name} {why}", param=name)


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's limits a request is checked against."""

    max_seq_len: int | None
    max_new_tokens_limit: int
    max_total_tokens: int | None
    max_rows: int
    """Choices one request may ask for in all (prompts x ``n``)."""
    vocab_size: int | None


@dataclass(frozen=True, slots=True)
class Choice:
    """One row to decode: a prompt (by index) and its sampling."""

    prompt_index: int
    tokens: list[int]
    sampling: SamplingConfig


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated request: the rows to decode (choice ``i`` is ``choices[i]``) and how to answer."""

    kind: Literal["completion", "chat"]
    choices: list[Choice]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: int | None
    """Alternatives per token whose log-probabilities are reported; ``None``: no logprobs."""


def _common(req: _Sampling, model_name: str) -> None:
    if req.model is not None and req.model != model_name:
        raise APIError(
            404,
            f"the model {req.model!r} does not exist: this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise _unsupported(name, "is not supported by this server (only 0)")
    if req.logit_bias:
        raise _unsupported("logit_bias")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise _unsupported("stream_options.continuous_usage_stats")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")


def _rows(
    req: _Sampling,
    prompts: Sequence[list[int]],
    *,
    max_tokens: int | None,
    default_max_tokens: int,
    stop: Sequence[str],
    limits: Limits,
) -> list[Choice]:
    if len(prompts) * req.n > limits.max_rows:
        raise APIError(
            400,
            f"{len(prompts)} prompt(s) x n={req.n} is {len(prompts) * req.n} choices, more than "
            f"the server's limit of {limits.max_rows}",
            param="n",
        )
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) + len(stop) > _MAX_STOPS or not all(stops):
        raise APIError(400, f"stop must hold 1 to {_MAX_STOPS} non-empty strings", param="stop")
    new = max_tokens if max_tokens is not None else default_max_tokens
    if new > limits.max_new_tokens_limit:
        raise APIError(
            400,
            f"max_tokens must be <= {limits.max_new_tokens_limit} (the server's limit), got {new}",
            param="max_tokens",
        )
    out = []
    for index, tokens in enumerate(prompts):
        where = f"prompt {index} " if len(prompts) > 1 else "the prompt "
        if not tokens:
            raise APIError(400, f"{where}encodes to no tokens", param="prompt")
        if limits.vocab_size is not None and not all(0 <= t < limits.vocab_size for t in tokens):
            raise APIError(
                400, f"{where}holds token ids outside [0, {limits.vocab_size})", param="prompt"
            )
        if limits.max_seq_len is not None and len(tokens) > limits.max_seq_len:
            raise APIError(
                400,
                f"{where}is {len(tokens)} tokens, longer than the model's context of "
                f"{limits.max_seq_len}",
                param="prompt",
            )
        wanted = new
        if limits.max_total_tokens is not None and len(tokens) + new > limits.max_total_tokens:
            if max_tokens is not None:
                raise APIError(
                    400,
                    f"{where}({len(tokens)} tokens) + max_tokens ({new}) is over the server's "
                    f"limit of {limits.max_total_tokens} tokens",
                    param="max_tokens",
                )
            wanted = max(1, limits.max_total_tokens - len(tokens))
        base = secrets.randbits(64) if req.seed is None else req.seed % _SEEDS
        for i in range(req.n):
            sampling = SamplingConfig(
                max_new_tokens=wanted,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=max(0, req.top_k or 0),
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=(base + i) % _SEEDS,
                stop_strings=(*stops, *stop),
            )
            out.append(Choice(prompt_index=index, tokens=tokens, sampling=sampling))
    return out


def _plan(
    kind: Literal["completion", "chat"],
    req: _Sampling,
    choices: list[Choice],
    logprobs: int | None,
) -> Plan:
    usage = req.stream_options is not None and bool(req.stream_options.include_usage)
    return Plan(
        kind=kind,
        choices=choices,
        stream=req.stream,
        include_usage=usage,
        return_token_ids=req.return_token_ids,
        logprobs=logprobs,
    )


def plan_completion(
    req: CompletionRequest,
    *,
    model_name: str,
    encode: Callable[[str], list[int]],
    limits: Limits,
) -> Plan:
    """The rows of a completion request (``len(prompts) * n``), or :class:`APIError`."""
    _common(req, model_name)
    if req.echo:
        raise _unsupported("echo")
    if req.suffix:
        raise _unsupported("suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise _unsupported("best_of", "is not supported by this server (only best_of == n)")
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [encode(prompt)]
    elif prompt and isinstance(prompt[0], list):
        prompts = [list(p) for p in prompt]  # type: ignore[arg-type]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = [encode(p) for p in prompt]  # type: ignore[arg-type]
    if not prompts:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    choices = _rows(
        req, prompts, max_tokens=req.max_tokens, default_max_tokens=16, stop=(), limits=limits
    )
    return _plan("completion", req, choices, req.logprobs)


def plan_chat(
    req: ChatCompletionRequest,
    *,
    model_name: str,
    encode: Callable[[str], list[int]],
    template: ChatTemplate,
    limits: Limits,
) -> Plan:
    """The rows of a chat request: its messages rendered by ``template``, then ``n`` rows."""
    _common(req, model_name)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.tools or (req.tool_choice not in (None, "none")):
        raise _unsupported("tools")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise APIError(
            400, "give max_tokens or max_completion_tokens, not both", param="max_tokens"
        )
    messages = []
    for i, m in enumerate(req.messages):
        content = (
            m.content
            if isinstance(m.content, str) or m.content is None
            else ("".join(part.text for part in m.content))
        )
        message = {"role": m.role, "content": content or ""}
        if m.name is not None:  # the template renders it (ours: "# user (alice): ...")
            if not m.name.strip() or any(c in m.name for c in "\r\n"):
                raise APIError(
                    400,
                    f"messages[{i}].name must be a non-empty name on one line, got {m.name!r}",
                    param=f"messages[{i}].name",
                )
            message["name"] = m.name
        messages.append(message)
    prompt = encode(template.render(messages))
    limit = limits.max_new_tokens_limit
    if limits.max_seq_len is not None:
        limit = max(1, min(limit, limits.max_seq_len - len(prompt) + 1))
    choices = _rows(
        req,
        [prompt],
        max_tokens=req.max_tokens if req.max_tokens is not None else req.max_completion_tokens,
        default_max_tokens=limit,
        stop=template.stop,
        limits=limits,
    )
    return _plan("chat", req, choices, (req.top_logprobs or 0) if req.logprobs else None)


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's ``finish_reason``: ``stop`` (a stop string or token), ``length`` otherwise."""
    return "stop" if result.stop_reason in ("stop_token", "stop_string") else "length"


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


LogprobEntry = tuple[float, list[tuple[int, float]]]


def token_text(decode: Callable[[Sequence[int]], str], token: int) -> tuple[str, list[int]]:
    """A token as logprobs show it, and its bytes: decoded, or ``bytes:\\xNN`` for a byte
    token that is not a whole UTF-8 character (vLLM's convention)."""
    text = decode([token])
    if "\ufffd" in text and 0 <= token < 256:
        return f"bytes:\\x{token:02x}", [token]
    return text, list(text.encode())


def logprobs_block(
    plan: Plan,
    tokens: Sequence[int],
    entries: Sequence[LogprobEntry],
    decode: Callable[[Sequence[int]], str],
    *,
    before: Sequence[int] = (),
) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of ``tokens``, which follow ``before`` in the completion
    (completions: parallel lists, ``text_offset`` = the length of the decoded completion
    before each token; chat: ``content`` entries with ``bytes``); ``None`` when not asked."""
    if plan.logprobs is None:
        return None
    shown = [token_text(decode, t) for t in tokens]
    if plan.kind == "chat":
        content = []
        for (text, raw), (lp, top) in zip(shown, entries, strict=True):
            alternatives = []
            for t, v in top:
                alt, alt_raw = token_text(decode, t)
                alternatives.append({"token": alt, "logprob": v, "bytes": alt_raw})
            content.append(
                {"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives}
            )
        return {"content": content}
    prefix = list(before)
    offsets = []
    for t in tokens:
        offsets.append(len(decode(prefix)))
        prefix.append(t)
    return {
        "tokens": [text for text, _ in shown],
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [
            {text: lp, **{token_text(decode, t)[0]: v for t, v in top}}
            for (text, _), (lp, top) in zip(shown, entries, strict=True)
        ],
        "text_offset": offsets,
    }


def response(
    plan: Plan,
    results: Sequence[GenerationResult],
    *,
    rid: str,
    model_name: str,
    logprobs: Sequence[Sequence[LogprobEntry]] = (),
    decode: Callable[[Sequence[int]], str] | None = None,
) -> dict[str, Any]:
    """The whole answer to a request that did not stream (``logprobs``: per choice, per token,
    when the plan asks for them)."""
    choices = []
    for index, result in enumerate(results):
        text = result.text or ""
        block = None
        if plan.logprobs is not None:
            assert decode is not None
            block = logprobs_block(plan, result.tokens, logprobs[index], decode)
        if plan.kind == "chat":
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": block,
                "finish_reason": finish_reason(result),
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": block,
                "finish_reason": finish_reason(result),
            }
        if plan.return_token_ids:
            choice["token_ids"] = list(result.tokens)
        choices.append(choice)
    prompts = {c.prompt_index: len(c.tokens) for c in plan.choices}
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if plan.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": usage(sum(prompts.values()), sum(len(r.tokens) for r in results)),
    }
    if plan.return_token_ids:
        body["prompt_token_ids"] = [c.tokens for c in plan.choices[:: max(1, _n(plan))]]
    return body


def _n(plan: Plan) -> int:
    return sum(1 for c in plan.choices if c.prompt_index == 0)


def chunk(
    plan: Plan,
    *,
    rid: str,
    model_name: str,
    created: int,
    index: int,
    text: str | None,
    finish: str | None = None,
    role: bool = False,
    token_ids: list[int] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stream chunk for choice ``index``: a text delta and/or its ``finish_reason``."""
    if plan.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs}
    choice["finish_reason"] = finish
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": rid,
        "object": "chat.completion.chunk" if plan.kind == "chat" else "text_completion",
        "created": created,
        "model": model_name,
        "choices": [choice],
    }


def usage_chunk(plan: Plan, *, rid: str, model_name: str, created: int, completion: int) -> dict:
    prompts = {c.prompt_index: len(c.tokens) for c in plan.choices}
    return {
        "id": rid,
        "object": "chat.completion.chunk" if plan.kind == "chat" else "text_completion",
        "created": created,
        "model": model_name,
        "choices": [],
        "usage": usage(sum(prompts.values()), completion),
    }
