"""The engine protocol: what frontends and Ray replicas send to an engine and get back.

An engine takes a `GenerateRequest` and streams `GenerateDelta`s as an async generator:

    async for delta in engine.generate(request):   # token deltas, the last one has finish_reason
        ...

Aborting (closing the generator, or `engine.abort(request_id)`) frees the request's KV chunks.
A request the engine cannot serve fails with a typed `EngineError` (below); frontends map the type, never
the message, to a status code. This module (and `sampling.py`) imports neither torch nor the model, so a
frontend that only tokenises can use it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from chunkserve.workers.cache_control import PinSpec
from chunkserve.workers.sampling import SamplingParams


# ---- errors ---------------------------------------------------------------------------------------------
class EngineError(RuntimeError):
    """A request failed inside the engine (the message says why); other requests are unaffected.

    Subclasses say what went wrong; ``kind`` is a stable name for logs and metrics. Instances carry only
    their message, so they pickle across Ray."""

    kind: ClassVar[str] = "engine_error"


class InvalidRequestError(EngineError, ValueError):
    """The request itself is invalid (empty prompt, token ids out of the vocabulary, duplicate id)."""

    kind: ClassVar[str] = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus one generated token) exceeds the engine's context length."""

    kind: ClassVar[str] = "prompt_too_long"


class KVPoolTooSmallError(InvalidRequestError):
    """The request needs more KV chunks than the engine's pool can ever hold."""

    kind: ClassVar[str] = "kv_pool_too_small"


class InvalidSamplingError(InvalidRequestError):
    """The sampling parameters are invalid."""

    kind: ClassVar[str] = "invalid_sampling"


class PinRefusedError(EngineError):
    """A ``cache_control`` pin was refused (the tenant's pinned-token quota, or the pool's share for pins, is
    used up) and the tenant's settings say to fail rather than serve the request unpinned."""

    kind: ClassVar[str] = "pin_refused"


class EngineStepError(EngineError):
    """The engine failed while running the request (a step raised); the request was aborted."""

    kind: ClassVar[str] = "step_failed"


class EngineDeadError(EngineError):
    """The engine is gone (shut down, its thread or its replica died); retrying elsewhere may succeed."""

    kind: ClassVar[str] = "engine_gone"


# ---- requests and deltas ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: bytes = b""  # tenant cache scope; equal salts may share prefixes
    tenant: str = "public"
    weight: float = 1.0  # the tenant's fair-share weight (workers/fairness.py)
    cache_pin: PinSpec | None = None  # cache_control: pin the marked prefix (workers/pins.py)


@dataclass
class GenerateDelta:
    """New output of one request. A coalesced stream item is one delta carrying several tokens."""

    request_id: str
    token_ids: list[int]  # new tokens since the last delta
    text: str  # detokenised text of those tokens (may be "" while a UTF-8 sequence is incomplete)
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # total so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[float] | None = None
    first_token_time: float | None = None  # monotonic seconds, set on the delta carrying token 1
    num_cache_creation_tokens: int = 0  # prompt tokens this request wrote to the cache under a pin
    extra: dict = field(default_factory=dict)


@runtime_checkable
class EngineProtocol(Protocol):
    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...


__all__ = [
    "EngineDeadError", "EngineError", "EngineProtocol", "EngineStepError", "GenerateDelta", "GenerateRequest",
    "InvalidRequestError", "InvalidSamplingError", "KVPoolTooSmallError", "PinRefusedError", "PromptTooLongError",
]
