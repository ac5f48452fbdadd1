"""The engine protocol: what frontends and Ray replicas send to an engine and get back.

An engine takes a `GenerateRequest` and streams `GenerateDelta`s as an async generator:

    async for delta in engine.generate(request):   # token deltas, the last one has finish_reason
        ...

Aborting (closing the generator, or `engine.abort(request_id)`) frees the request's KV chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from chunkserve.workers.sampling import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: bytes = b""  # tenant cache scope; equal salts may share prefixes
    tenant: str = "public"


@dataclass
class GenerateDelta:
    request_id: str
    token_ids: list[int]  # new tokens since the last delta
    text: str  # detokenised text of those tokens (may be "" while a UTF-8 sequence is incomplete)
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # total so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[float] | None = None
    first_token_time: float | None = None  # monotonic seconds, set on the delta carrying token 1
    extra: dict = field(default_factory=dict)


@runtime_checkable
class EngineProtocol(Protocol):
    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...
