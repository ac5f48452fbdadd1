"""OpenAI-compatible request models, their validation, response bodies and the OpenAI error JSON.

Request bodies are parsed with ``parse_request`` (strict JSON validation, extra fields forbidden), so any
bad body becomes an ``APIError`` carrying the HTTP status and ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

INT64_MAX = 2**63 - 1


class APIError(Exception):
    """An error that becomes OpenAI error JSON with an HTTP status (and a gRPC status in the gRPC path)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_to_api_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 naming the first offending field of a pydantic / FastAPI validation error list."""
    if not errors:
        return APIError(400, "invalid request body")
    parts = []
    for e in errors[:3]:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    first = [str(x) for x in errors[0].get("loc", ()) if x != "body"]
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    return APIError(400, "; ".join(parts) + more, param=first[0] if first else None, code="invalid_value")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class CacheControl(_Strict):
    """Anthropic's cache mark: pin the prompt up to the end of the marked message for ``ttl``."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # marks the whole message (pinned to its end)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None
    cache_control: CacheControl | None = None  # extension (Anthropic's shape): pin up to this message's end

    def cache_mark(self) -> CacheControl | None:
        """This message's cache mark, on the message or on one of its parts (the last one wins)."""
        marks = [self.cache_control] if self.cache_control is not None else []
        if not isinstance(self.content, str):
            marks += [p.cache_control for p in self.content if p.cache_control is not None]
        return marks[-1] if marks else None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(_Strict):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 or -1 = off
    ignore_eos: bool | None = None  # extension (vLLM, llama.cpp): generate max_tokens tokens past end-of-sequence
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    n: int | None = 1
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # accepted for client compatibility; only their neutral values are supported
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are supported")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and info.data.get("stream") is not True:  # as OpenAI and vLLM: a 400, not ignored
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported, got n={v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def cache_mark(self) -> tuple[int, CacheControl] | None:
        """(index of the last marked message, its mark): the prompt is pinned up to that message's end."""
        for i in range(len(self.messages) - 1, -1, -1):
            mark = self.messages[i].cache_mark()
            if mark is not None:
                return i, mark
        return None

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in self.messages]


TEMPLATE_CHARS_PER_MESSAGE = 32  # a chat template's markup around each message (role, start and end tokens)


def template_chars(messages: list[dict[str, str]]) -> int:
    """About how many characters the chat template renders for ``messages``: their text plus each message's
    markup, so that many short messages count as the long text they become."""
    return sum(len(m["content"]) + TEMPLATE_CHARS_PER_MESSAGE for m in messages)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            v = v[0]
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if any(t < 0 or t > 2**31 - 1 for t in v):
                raise ValueError("prompt token ids must be in [0, 2^31)")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo", "logprobs", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("this parameter is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v


def parse_request(body: bytes, model_cls: type[_Strict], max_body_bytes: int, max_items: int | None = None) -> Any:
    """Parses and validates a JSON request body; raises APIError (400 / 413) for any bad input. ``max_items``
    (the context length: each message or content part costs a token at least) refuses a body of more messages
    or parts before the model validation, which holds the event loop (and the GIL) for ~3 us an item."""
    if len(body) > max_body_bytes:
        raise APIError(413, f"request body of {len(body)} bytes exceeds the limit of {max_body_bytes}",
                       code="request_too_large")
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    if max_items is not None and (n := _items(data)) > max_items:
        raise APIError(413, f"the request has {n} messages and content parts; this model's context of {max_items} "
                       f"tokens cannot hold them", code="context_length_exceeded")
    try:
        # strict: "5" is no int and 1 is no bool; floats still accept JSON integers.
        return model_cls.model_validate_json(body)
    except ValidationError as e:
        raise validation_to_api_error(e.errors(include_url=False)) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None


def _items(data: dict[str, Any]) -> int:
    """Messages and their content parts in a chat body (0 for others)."""
    msgs = data.get("messages")
    if not isinstance(msgs, list):
        return 0
    return len(msgs) + sum(len(m["content"]) for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), list))


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               cache_creation_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage block; ``cached_tokens`` were read from the prefix cache, ``cache_creation_tokens``
    written to it under a ``cache_control`` pin (extension)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "cache_creation_tokens": cache_creation_tokens},
    }


def usage_of(delta: Any) -> dict[str, Any]:
    """The usage block of a request's last `GenerateDelta`."""
    return usage_body(delta.num_prompt_tokens, delta.num_output_tokens, delta.num_cached_tokens,
                      getattr(delta, "num_cache_creation_tokens", 0))


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI spells it ('stop' | 'length'); None while running."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def chat_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                  usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": openai_finish_reason(finish_reason)}],
        "usage": usage,
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any] | None,
               finish_reason: str | None = None, usage: dict[str, Any] | None = None,
               null_usage: bool = False) -> dict[str, Any]:
    """One chat SSE chunk; ``delta=None`` makes the final usage-only chunk (empty choices). ``null_usage``:
    ``"usage": null`` in a chunk without usage, as OpenAI sends every other chunk under ``include_usage``."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": openai_finish_reason(finish_reason)}]
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": choices}
    if usage is not None or null_usage:
        body["usage"] = usage
    return body


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                        usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": openai_finish_reason(finish_reason)}],
        "usage": usage,
    }


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish_reason: str | None = None,
                     usage: dict[str, Any] | None = None, null_usage: bool = False) -> dict[str, Any]:
    """One completions SSE chunk; ``text=None`` makes the final usage-only chunk (empty choices); ``null_usage``
    as in `chat_chunk`."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None,
                                        "finish_reason": openai_finish_reason(finish_reason)}]
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": choices}
    if usage is not None or null_usage:
        body["usage"] = usage
    return body


def models_response(model_ids: list[str], created: int, owner: str = "chunkserve") -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": owner} for m in model_ids]}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event line pair."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
