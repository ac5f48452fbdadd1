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

from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

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
    arrival_time: float | None = None  # wall-clock time the frontend received it (queue order); None: now


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
    timeline: FirstTokenTimeline | None = None  # a served engine's stamps, on the delta carrying token 1


@dataclass(frozen=True)
class FirstTokenTimeline:
    """Wall-clock stamps (``time.time()``) of one request on its way to its first token, taken by a served engine
    (`AsyncEngine`); the ingress adds its own and exports the legs (`chunkserve:ttft_leg_seconds`). Stamps of
    different hosts agree as well as their clocks do (NTP: about a millisecond)."""

    worker_s: float  # the worker handed the request to the engine thread
    intake_s: float  # the engine thread took it, between two steps
    admitted_s: float  # the scheduler first admitted it (its tenant's turn, room in the pool)
    first_token_s: float  # the step that sampled its first token ended

    def legs(self, received_s: float, called_s: float, returned_s: float) -> dict[str, float]:
        """Seconds per leg, with the frontend's stamps: ``received_s`` (it got the request), ``called_s`` (it called
        the engine) and ``returned_s`` (the first token reached it). Each leg is at least 0 (clock skew)."""
        stamps = (received_s, called_s, self.worker_s, self.intake_s, self.admitted_s, self.first_token_s, returned_s)
        return {leg: max(0.0, b - a) for leg, a, b in zip(TTFT_LEGS, stamps[:-1], stamps[1:], strict=True)}


# parse, auth, tokenise, rate limits | router, call into the worker | the engine step in flight | the scheduler's
# queue (fair share, pool room) | its prefill steps and the first sample | the first item back to the frontend
TTFT_LEGS = ("ingress", "route", "step_wait", "admission", "prefill", "return")


# ---- stats ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineStats(Mapping[str, Any]):
    """One snapshot of an engine's figures, under the same names everywhere: the engine's ``stats()``, the
    worker's metrics and Redis snapshot, the router's load, the load-test samples and report.

    Read it by attribute; it is also a read-only mapping of the same names (``dict(stats)``, ``stats["x"]``),
    which is what `LLM.stats()` and the JSON snapshots are. `from_dict` refuses a snapshot that lacks a field, so
    a renamed key fails loudly instead of being skipped; keys it does not know land in ``extra``."""

    kv_chunks_total: int  # the pool (workers/kvcache.py `PrefixKVCache.stats`)
    kv_chunks_used: int  # referenced by live sequences
    kv_chunks_free: int
    kv_chunks_cached: int  # kept only as prefix cache (evictable)
    num_sequences: int
    logical_tokens: int
    physical_tokens: int
    shared_tokens: int
    sharing_ratio: float
    kv_bytes_used: int
    peak_kv_bytes: int
    bytes_per_chunk: int
    num_requests_running: int  # the engine (workers/engine.py `EngineCore.stats`)
    num_requests_waiting: int
    num_preemptions: int  # cumulative
    num_steps: int
    tokens_computed: int
    prompt_tokens_total: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_cached_tokens: int  # cumulative prompt tokens served from it
    kv_cache_usage_perc: float  # kv_chunks_used / kv_chunks_total
    chunk_size: int
    pinned_chunks: int = 0  # the scheduler (workers/scheduler.py `Scheduler.stats`)
    fair_share: bool = True
    tenant_sched: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per tenant
    step_busy_s: float = 0.0  # the served engine thread (workers/thread_clock.py), cumulative: wall in steps,
    step_cpu_s: float = 0.0  # its CPU time in them,
    step_runqueue_s: float = 0.0  # and its wait for a core other processes held (Linux)
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # keys not declared above

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineStats:
        missing = sorted(_STATS_REQUIRED - d.keys())
        if missing:
            raise KeyError(f"engine stats lack {missing} (a renamed or dropped field?)")
        known = {k: v for k, v in d.items() if k in _STATS_FIELDS}
        extra = {k: v for k, v in d.items() if k not in _STATS_FIELDS}
        return cls(**known, extra=MappingProxyType(extra))

    def as_dict(self) -> dict[str, Any]:
        return dict(self)

    def __getitem__(self, key: str) -> Any:
        if key in _STATS_FIELDS:
            return getattr(self, key)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from _STATS_FIELDS
        yield from self.extra

    def __len__(self) -> int:
        return len(_STATS_FIELDS) + len(self.extra)


_STATS_FIELDS = tuple(f.name for f in fields(EngineStats) if f.name != "extra")
_STATS_REQUIRED = frozenset(f.name for f in fields(EngineStats) if f.default is f.default_factory is MISSING)


@runtime_checkable
class EngineProtocol(Protocol):
    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> Mapping[str, Any]: ...  # an `EngineStats` for engines of this package


__all__ = [
    "EngineDeadError", "EngineError", "EngineProtocol", "EngineStats", "EngineStepError", "GenerateDelta",
    "GenerateRequest",
    "InvalidRequestError", "InvalidSamplingError", "KVPoolTooSmallError", "PinRefusedError", "PromptTooLongError",
]
