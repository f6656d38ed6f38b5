"""OpenAI's HTTP protocol for `qkvshare serve`: requests read and checked, answers and stream chunks written.

Standard library only (no torch, no transformers): what a request asks for is decided here, before any token is
generated, and every refusal is a `RequestError` (an HTTP status and a message in OpenAI's error shape,
`{"error": {"message", "type", "param", "code"}}`, which the `openai` client shows).

Every field a request may carry is in one of three tables per endpoint:
- `COMMON_FIELDS` and the endpoint's own fields: implemented, each checked (`FIELD_CHECKS`: a bad value is a 400
  naming the field and what it must be);
- `NEUTRAL_FIELDS`: fields this server does not implement, accepted only with the value that asks for nothing
  (`presence_penalty=0`, `tools=[]`, `response_format={"type": "text"}`, ...);
- anything else is a 400 naming the fields ("not implemented by this server"), never silently ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

MAX_N = 16  # choices per prompt (`n`)
MAX_SEQUENCES = 64  # prompts x n of one request
MAX_COMPLETION_LOGPROBS = 5  # `logprobs` of /v1/completions (OpenAI's bound)
MAX_TOP_LOGPROBS = 20  # `top_logprobs` of /v1/chat/completions (OpenAI's bound)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat and responses run to the context


class RequestError(Exception):
    """A request this server answers with an HTTP error: `status` (4xx: the request; 5xx: the server), `message`
    (what is wrong and what to do), `code` and `param` as OpenAI fills them."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        kind = {429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code or self.status}}


# ----------------------------------------------------------------------------------------------------------------
# field checks
# ----------------------------------------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_whole(t) for t in value)


def _prompt(value: Any) -> bool:
    """A string, a list of token ids, or a non-empty list of either (several prompts)."""
    if isinstance(value, str) or _token_ids(value):
        return True
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(p, str) or (isinstance(p, list) and all(_whole(t) for t in p)) for p in value)
    )


def _messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _stop(value: Any) -> bool:
    strings = [value] if isinstance(value, str) else value
    return isinstance(strings, list) and len(strings) <= 4 and all(isinstance(s, str) and s for s in strings)


# field -> (test, what the value must be). The sampling bounds are OpenAI's; frequency_penalty becomes generate()'s
# repetition_penalty = 1 + frequency_penalty, which must be positive.
FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "max_tokens": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "max_completion_tokens": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "max_output_tokens": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "temperature": (lambda v: _number(v) and 0 <= v <= 2, "a number from 0 to 2 (0: greedy)"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "frequency_penalty": (lambda v: _number(v) and -1 < v <= 2, "a number in (-1, 2]"),
    "seed": (_whole, "a whole number"),
    "n": (lambda v: _whole(v) and 1 <= v <= MAX_N, f"a whole number from 1 to {MAX_N}"),
    "stop": (_stop, "a non-empty string or a list of at most 4 non-empty strings"),
    "stream": (lambda v: isinstance(v, bool), "true or false"),
    "stream_options": (
        lambda v: (
            isinstance(v, dict) and set(v) <= {"include_usage"} and isinstance(v.get("include_usage", False), bool)
        ),
        'an object {"include_usage": true|false}',
    ),
    "user": (lambda v: isinstance(v, str), "a string"),
    "prompt": (_prompt, "a string, a list of token ids, or a non-empty list of strings or of token-id lists"),
    "echo": (lambda v: isinstance(v, bool), "true or false"),
    "logprobs": (
        lambda v: _whole(v) and 0 <= v <= MAX_COMPLETION_LOGPROBS,
        f"a whole number from 0 to {MAX_COMPLETION_LOGPROBS} (alternatives per token)",
    ),
    "messages": (_messages, "a non-empty list of messages, each an object with a role"),
    "input": (lambda v: isinstance(v, str | list) and bool(v), "a non-empty string or list of input items"),
    "instructions": (lambda v: isinstance(v, str), "a string"),
    "top_logprobs": (
        lambda v: _whole(v) and 0 <= v <= MAX_TOP_LOGPROBS,
        f"a whole number from 0 to {MAX_TOP_LOGPROBS}",
    ),
}
CHAT_LOGPROBS = (lambda v: isinstance(v, bool), "true or false")  # chat's `logprobs` is a flag

COMMON_FIELDS = {"model", "temperature", "top_p", "seed", "stream", "user"}
ENDPOINT_FIELDS = {
    "completions": COMMON_FIELDS
    | {"prompt", "max_tokens", "n", "stop", "stream_options", "frequency_penalty", "echo", "logprobs"},
    "chat.completions": COMMON_FIELDS
    | {
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stop",
        "stream_options",
        "frequency_penalty",
        "logprobs",
        "top_logprobs",
    },
    "responses": COMMON_FIELDS | {"input", "instructions", "max_output_tokens"},
}
REQUIRED_FIELDS = {"completions": ("prompt",), "chat.completions": ("messages",), "responses": ("input",)}


def _empty(value: Any) -> bool:
    return value in (None, [], {}, "")


# Fields this server does not implement, accepted with the value that asks for nothing: field -> (test of that
# value, what it would need). Any other value is a 400 naming the field.
NEUTRAL_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (lambda v: v in (None, 0), "presence penalties"),
    "logit_bias": (_empty, "logit biases"),
    "suffix": (_empty, "fill-in-the-middle (suffix)"),
    "tools": (_empty, "tools"),
    "functions": (_empty, "functions"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calls"),
    "function_call": (lambda v: v in (None, "none", "auto"), "function calls"),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "tool calls"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "structured output (response_format)"),
    "text": (lambda v: v is None or v in ({"format": {"type": "text"}}, {}), "structured output (text.format)"),
    "modalities": (lambda v: v in (None, ["text"]), "output other than text"),
    "audio": (_empty, "audio output"),
    "prediction": (_empty, "predicted outputs"),
    "reasoning_effort": (_empty, "reasoning settings"),
    "reasoning": (_empty, "reasoning settings"),
    "web_search_options": (_empty, "web search"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "service tiers"),
    "store": (lambda v: v in (None, False), "stored completions (store=true)"),
    "metadata": (lambda v: v is None or isinstance(v, dict), "metadata"),  # kept only with store=true
    "previous_response_id": (_empty, "conversation state (previous_response_id)"),
    "include": (_empty, "extra output (include)"),
    "truncation": (lambda v: v in (None, "disabled"), "automatic truncation"),
    "background": (lambda v: v in (None, False), "background responses"),
    "best_of": (lambda v: v in (None, 1), "best_of (use n)"),
}


@dataclass
class Sampling:
    """The sampling fields of a request (None: the model's generation config decides)."""

    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None

    def generation_overrides(self) -> dict[str, Any]:
        """`GenerationConfig` fields for generate(): temperature 0 is greedy; frequency_penalty is transformers'
        repetition_penalty (1 + frequency_penalty)."""
        overrides: dict[str, Any] = {}
        if self.temperature is not None:
            if self.temperature == 0:
                overrides["do_sample"] = False
            else:
                overrides["temperature"] = float(self.temperature)
        if self.top_p is not None:
            overrides["top_p"] = float(self.top_p)
        if self.frequency_penalty is not None:
            overrides["repetition_penalty"] = 1.0 + float(self.frequency_penalty)
        return overrides


@dataclass
class ParsedRequest:
    """What one request asks for, checked against the protocol (not yet against the model: see the server's
    admission)."""

    endpoint: str  # "completions", "chat.completions" or "responses"
    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)  # /v1/completions
    messages: list[dict[str, str]] | None = None  # chat and responses: {"role", "content"} with text content
    max_tokens: int | None = None  # None: to the end of the model's context; 0: score the prompt only (echo)
    n: int = 1
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token (0: the chosen token's only); None: no logprobs
    echo: bool = False  # completions: the prompt (and its logprobs) in front of the completion


def check_fields(endpoint: str, body: dict) -> None:
    """A 400 naming every field of `body` that `endpoint` does not implement, every bad value, every missing
    required field."""
    accepted = ENDPOINT_FIELDS[endpoint]
    unsupported = sorted(
        name
        for name, value in body.items()
        if name not in accepted and not (name in NEUTRAL_FIELDS and NEUTRAL_FIELDS[name][0](value))
    )
    if unsupported:
        reasons = [f"{name} ({NEUTRAL_FIELDS[name][1]})" if name in NEUTRAL_FIELDS else name for name in unsupported]
        raise RequestError(
            400,
            f"Unsupported field{'s' if len(unsupported) > 1 else ''} for /v1/{endpoint.replace('.', '/')}: "
            f"{', '.join(reasons)}: not implemented by this server. Leave "
            f"{'them' if len(unsupported) > 1 else 'it'} out.",
            code="unsupported_field",
            param=unsupported[0],
        )
    bad = [f"{name} is required" for name in REQUIRED_FIELDS[endpoint] if body.get(name) is None]
    for name, value in body.items():
        if value is None or name not in accepted:
            continue
        test, need = CHAT_LOGPROBS if (endpoint, name) == ("chat.completions", "logprobs") else FIELD_CHECKS[name]
        if (endpoint, name, value) == ("completions", "max_tokens", 0) and body.get("echo") is True:
            continue  # score the prompt without generating (OpenAI's legacy completions allow it with echo)
        if not test(value):
            bad.append(f"{name}={value!r} (must be {need})")
    if bad:
        raise RequestError(400, "Invalid request: " + "; ".join(bad) + ".", param=None)


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, or a list of text parts ("text", "input_text", "output_text")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
                raise RequestError(
                    400,
                    f"Invalid request: {where} holds a content part of type {kind!r}; this server takes text only "
                    "(a string, or parts of type 'text').",
                    param=where,
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(400, f"Invalid request: {where}.content must be a string or a list of text parts.", param=where)


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(messages: list[dict], where: str = "messages") -> list[dict[str, str]]:
    """OpenAI messages as the chat template takes them: {"role", "content"} with text content; "developer" is the
    system role. Tool calls and tool messages are refused (this server implements no tools)."""
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(
                400,
                f"Invalid request: {where}[{i}].role={role!r} (must be one of {', '.join(CHAT_ROLES)}; this server "
                "implements no tools).",
                param=f"{where}[{i}].role",
            )
        if message.get("tool_calls"):
            raise RequestError(400, f"Invalid request: {where}[{i}] has tool_calls; this server implements no tools.")
        out.append({"role": CHAT_ROLES[role], "content": _text_of(message.get("content"), f"{where}[{i}]")})
    return out


def response_input_messages(body: dict) -> list[dict[str, str]]:
    """The messages of a /v1/responses request: `instructions` as a system message, then `input` (a string: one
    user message; or a list of message items)."""
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    items = body["input"]
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise RequestError(
                400, f"Invalid request: input[{i}] is of type {kind!r}; this server takes message items only."
            )
    return messages + chat_messages(items, "input")


def parse_request(endpoint: str, body: Any) -> ParsedRequest:
    """The checked request of `body` for `endpoint` ("completions", "chat.completions", "responses"); a
    `RequestError` (400) naming what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(422, "Invalid request body: send a JSON object.")
    check_fields(endpoint, body)
    stream = bool(body.get("stream") or False)
    request = ParsedRequest(
        endpoint=endpoint,
        model=body.get("model"),
        n=body.get("n") or 1,
        sampling=Sampling(body.get("temperature"), body.get("top_p"), body.get("frequency_penalty"), body.get("seed")),
        stop=[body["stop"]] if isinstance(body.get("stop"), str) else list(body.get("stop") or []),
        stream=stream,
        include_usage=bool((body.get("stream_options") or {}).get("include_usage", False)),
    )
    if body.get("stream_options") is not None and not stream:
        raise RequestError(400, "Invalid request: stream_options is only allowed with stream=true.")
    if endpoint == "completions":
        prompt = body["prompt"]
        request.prompts = [prompt] if isinstance(prompt, str) or _token_ids(prompt) else list(prompt)
        request.echo = bool(body.get("echo") or False)
        request.logprobs = body.get("logprobs")
        request.max_tokens = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        if request.max_tokens is None:
            request.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        if stream and len(request.prompts) > 1:
            raise RequestError(400, "Invalid request: stream=true takes one prompt; send the prompts one by one.")
    elif endpoint == "chat.completions":
        request.messages = chat_messages(body["messages"])
        request.max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if body.get("logprobs"):
            request.logprobs = body.get("top_logprobs") or 0
        elif body.get("top_logprobs") is not None:
            raise RequestError(400, "Invalid request: top_logprobs needs logprobs=true.", param="top_logprobs")
    else:
        request.messages = response_input_messages(body)
        request.max_tokens = body.get("max_output_tokens")
    if len(request.prompts or [None]) * request.n > MAX_SEQUENCES:
        raise RequestError(
            400,
            f"Invalid request: {len(request.prompts)} prompts x n={request.n} = "
            f"{len(request.prompts) * request.n} sequences; this server generates at most {MAX_SEQUENCES} per "
            "request.",
        )
    return request


# ----------------------------------------------------------------------------------------------------------------
# answers
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TokenLogprob:
    """One token's log-probability and its most likely alternatives at that position (token text -> logprob)."""

    token: str
    logprob: float | None  # None: the first prompt token (nothing before it)
    top: list[tuple[str, float]] | None  # the most likely tokens there, most likely first (None with logprob None)
    token_bytes: list[int] = field(default_factory=list)


@dataclass
class ChoiceResult:
    """One finished choice: its text, why it ended, its token count and (when asked) per-token logprobs."""

    index: int
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens or the context's end)
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # completions with echo: prompt tokens first
    prompt_text: str = ""  # echo


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(tokens: list[TokenLogprob], start_offset: int = 0) -> dict:
    """OpenAI's legacy `logprobs` object: tokens, token_logprobs, top_logprobs (the `logprobs` most likely tokens
    and the chosen one, as the legacy API gives them), text_offset."""
    offsets, offset = [], start_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [None if t.logprob is None else _with_chosen(t) for t in tokens],
        "text_offset": offsets,
    }


def _with_chosen(token: TokenLogprob) -> dict[str, float]:
    """The alternatives of a position plus the chosen token (two tokens of one text keep the larger value, so the
    chosen token is the most likely exactly when its logprob is the maximum)."""
    top: dict[str, float] = {}
    for text, value in [*(token.top or []), (token.token, token.logprob)]:
        top[text] = max(top.get(text, value), value)
    return top


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": t.token_bytes,
                "top_logprobs": [
                    {"token": text, "logprob": value, "bytes": list(text.encode())} for text, value in t.top or []
                ],
            }
            for t in tokens
        ]
    }


def completion_body(request_id: str, model: str, choices: list[ChoiceResult], prompt_tokens: int) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.prompt_text + c.text,
                "finish_reason": c.finish_reason,
                "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs),
            }
            for c in choices
        ],
        "usage": usage(prompt_tokens, sum(c.completion_tokens for c in choices)),
    }


def chat_body(request_id: str, model: str, choices: list[ChoiceResult], prompt_tokens: int) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
            }
            for c in choices
        ],
        "usage": usage(prompt_tokens, sum(c.completion_tokens for c in choices)),
    }


def response_body(
    request_id: str, model: str, choice: ChoiceResult | None, prompt_tokens: int, status: str = "completed"
) -> dict:
    """A /v1/responses `Response` object (one message output item)."""
    text = choice.text if choice is not None else ""
    output = [
        {
            "id": f"msg_{request_id}",
            "type": "message",
            "role": "assistant",
            "status": "completed" if status == "completed" else "in_progress",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    ]
    completion = choice.completion_tokens if choice is not None else 0
    incomplete = choice is not None and choice.finish_reason == "length" and status == "completed"
    return {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "incomplete" if incomplete else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output if status == "completed" else [],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion,
        }
        if status == "completed"
        else None,
    }


def sse(data: dict | str) -> str:
    """One server-sent event (`data: ...`)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_event(kind: str, data: dict) -> str:
    """One named server-sent event (/v1/responses streams `event: <type>` lines)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def completion_chunk(request_id: str, model: str, index: int, text: str, finish_reason: str | None) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }


def chat_chunk(
    request_id: str, model: str, index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
    }


def usage_chunk(request_id: str, model: str, kind: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }
