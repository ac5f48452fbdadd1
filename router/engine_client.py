"""Engine clients: how the ingress reaches an engine, and what an engine error means to a client.

``LocalEngineClient`` wraps an in-process engine; ``HandleEngineClient`` a Ray Serve ``DeploymentHandle``
to the worker deployment. Both stream one request's (coalesced) `GenerateDelta`s; closing the stream aborts
the request. Engine failures arrive as the typed errors of `workers/protocol.py`, and `engine_error_to_api`
maps their type (never their message) to an HTTP status, an OpenAI error type and code (gRPC derives its
status from the HTTP one). Nothing here imports torch or the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from chunkserve.router.openai_api import APIError
from chunkserve.workers.protocol import (
    EngineDeadError,
    EngineError,
    EngineStepError,
    GenerateDelta,
    GenerateRequest,
    InvalidRequestError,
    InvalidSamplingError,
    KVPoolTooSmallError,
    PromptTooLongError,
)
from chunkserve.workers.streaming import StreamBatching


class EngineClient(Protocol):
    """What the ingress calls: streams the deltas of one request; closing the iterator aborts it."""

    def generate(self, request: GenerateRequest, chunk_hashes: list[int]) -> AsyncIterator[GenerateDelta]: ...


class LocalEngineClient:
    """An in-process engine (``workers.protocol.EngineProtocol``) as an engine client. With ``batching``
    (for an `AsyncEngine`) each request's deltas come coalesced, as a worker replica sends them."""

    def __init__(self, engine: Any, batching: StreamBatching | None = None) -> None:
        self.engine = engine
        self.batching = batching

    def generate(self, request: GenerateRequest, chunk_hashes: list[int]) -> AsyncIterator[GenerateDelta]:
        if self.batching is not None:
            return self.engine.generate(request, self.batching)
        return self.engine.generate(request)

    async def stats(self) -> dict:
        return dict(self.engine.stats())

    async def aclose(self) -> None:
        """Stops the engine (its step thread is joined off the event loop)."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            await asyncio.to_thread(shutdown)


class HandleEngineClient:
    """A Ray Serve DeploymentHandle to the worker deployment as an engine client.

    Calls ``handle.options(stream=True).<method>.remote(request, chunk_hashes=...)`` so a prefix-aware
    request router can read the hashes from the kwargs; an early exit cancels the call, which closes
    the worker's generator and frees the request's KV chunks. Each stream item is one (coalesced) delta.
    The worker's own exception is re-raised (a typed `EngineError`); a worker that died or that Serve
    cannot reach becomes `EngineDeadError`."""

    def __init__(self, handle: Any, method: str = "generate") -> None:
        self._handle = handle.options(stream=True)
        self._method = method

    async def generate(self, request: GenerateRequest, chunk_hashes: list[int]) -> AsyncIterator[GenerateDelta]:
        gen = getattr(self._handle, self._method).remote(request, chunk_hashes=chunk_hashes)
        finished = False
        try:
            async for delta in gen:
                if delta.finish_reason is not None:
                    finished = True
                yield delta
        except Exception as e:
            cause = getattr(e, "cause", None)  # a RayTaskError carries the worker's own exception
            if isinstance(cause, Exception):
                raise cause from None
            if _worker_unavailable(e):
                raise EngineDeadError(f"no worker could serve the request: {type(e).__name__}: {e}") from None
            raise
        finally:
            if not finished:
                gen.cancel()


# Engine error type -> (HTTP status, OpenAI error type, error code); the first matching row wins.
_ENGINE_ERRORS: tuple[tuple[type[EngineError], int, str, str | None], ...] = (
    (PromptTooLongError, 413, "invalid_request_error", "context_length_exceeded"),
    (KVPoolTooSmallError, 413, "invalid_request_error", "context_length_exceeded"),
    (InvalidSamplingError, 400, "invalid_request_error", "invalid_value"),
    (InvalidRequestError, 400, "invalid_request_error", None),
    (EngineDeadError, 503, "server_error", "engine_unavailable"),
    (EngineStepError, 500, "server_error", "engine_error"),
    (EngineError, 500, "server_error", "engine_error"),
)


def engine_error_to_api(e: EngineError) -> APIError:
    """The APIError (status, OpenAI type and code) for an engine error, chosen by its type."""
    for cls, status, kind, code in _ENGINE_ERRORS:
        if isinstance(e, cls):
            verb = "rejected" if status < 500 else "failed"
            return APIError(status, f"the engine {verb} the request: {e}", type=kind, code=code)
    raise TypeError(f"not an engine error: {e!r}")  # unreachable: EngineError is the last row


def _worker_unavailable(e: BaseException) -> bool:
    """Whether a Ray/Serve error means the worker is gone or unreachable (Ray is loaded when it raised one)."""
    module = type(e).__module__ or ""
    if not module.startswith("ray."):
        return False
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    return isinstance(e, RayActorError | BackPressureError | DeploymentUnavailableError)


async def next_delta(agen: AsyncIterator[GenerateDelta]) -> GenerateDelta | None:
    """The next (possibly coalesced) delta, or None at the end. An `EngineError` becomes the APIError its
    type maps to (`engine_error_to_api`)."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None
    except EngineError as e:
        raise engine_error_to_api(e) from None
