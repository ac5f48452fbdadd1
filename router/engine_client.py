"""Engine clients: how the ingress reaches an engine, and what an engine error means to a client.

``LocalEngineClient`` wraps an in-process engine; ``HandleEngineClient`` a Ray Serve ``DeploymentHandle``
to the worker deployment. Both stream one request's (coalesced) `GenerateDelta`s; closing the stream aborts
the request. Engine failures arrive as the typed errors of `workers/protocol.py`, and `engine_error_to_api`
maps their type (never their message) to an HTTP status, an OpenAI error type and code (gRPC derives its
status from the HTTP one). Nothing here imports torch or the model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
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
    PinRefusedError,
    PromptTooLongError,
)
from chunkserve.workers.streaming import StreamBatching


class EngineClient(Protocol):
    """What the ingress calls: streams the deltas of one request; closing the iterator aborts it."""

    def generate(self, request: GenerateRequest, chunk_hashes: list[int]) -> AsyncGenerator[GenerateDelta, None]: ...

    async def readiness(self) -> dict[str, Any]:
        """``{"ready": bool, "workers": int, ...}``: whether requests can be served now."""
        ...


class LocalEngineClient:
    """An in-process engine (``workers.protocol.EngineProtocol``) as an engine client. With ``batching``
    (for an `AsyncEngine`) each request's deltas come coalesced, as a worker replica sends them."""

    def __init__(self, engine: Any, batching: StreamBatching | None = None) -> None:
        self.engine = engine
        self.batching = batching

    def generate(self, request: GenerateRequest, chunk_hashes: list[int]) -> AsyncGenerator[GenerateDelta, None]:
        if self.batching is not None:
            return self.engine.generate(request, self.batching)
        return self.engine.generate(request)

    async def stats(self) -> dict:
        return dict(self.engine.stats())

    async def readiness(self) -> dict[str, Any]:
        """An in-process engine serves as soon as it exists, until its engine thread stops (then every request
        would fail: /ready answers 503)."""
        try:
            check = getattr(self.engine, "check_alive", None)
            if check is not None:
                check()
        except EngineDeadError as e:
            return {"ready": False, "workers": 0, "reason": str(e)}
        return {"ready": True, "workers": 1}

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
    Failures are classified by `classify_remote_error`: the worker's own typed `EngineError` is re-raised,
    a worker that died or that Serve cannot reach becomes `EngineDeadError` (retryable elsewhere)."""

    def __init__(self, handle: Any, method: str = "generate", status: Any = None, ready_cache_s: float = 0.5) -> None:
        """``status``: what reports Serve's state (default ``ray.serve.status``); ``ready_cache_s``: how long
        a `readiness` answer is reused."""
        self._handle = handle.options(stream=True)
        self._method = method
        self._app = getattr(handle, "app_name", None)
        self._deployment = getattr(handle, "deployment_name", None)
        self._status = status
        self._started = False  # the worker deployment has been fully up once (latched)
        self._ready_cache: tuple[float, dict[str, Any]] | None = None
        self._ready_cache_s = ready_cache_s

    async def readiness(self) -> dict[str, Any]:
        """Whether requests can be served, for load balancers and benchmarks (``GET /ready``): ready once
        the worker deployment has had all its initial replicas running (Serve's status), and from then on
        while at least one runs. A cluster still starting is not ready: a burst sent to it would be routed
        over the workers up so far (one of two, say) and stay there."""
        now = time.monotonic()
        if self._ready_cache is not None and now - self._ready_cache[0] < self._ready_cache_s:
            return self._ready_cache[1]
        if self._status is None:
            from ray import serve

            self._status = serve.status
        try:
            st = await asyncio.to_thread(self._status)
        except Exception as e:  # Serve's controller unreachable: not ready, and say why (never a 500)
            return {"ready": False, "workers": 0, "status": "UNKNOWN", "error": f"{type(e).__name__}: {e}"[:300]}
        app = st.applications.get(self._app)
        dep = app.deployments.get(self._deployment) if app is not None else None
        running = int(dep.replica_states.get("RUNNING", 0)) if dep is not None else 0
        status = str(getattr(dep.status, "value", dep.status)) if dep is not None else "NOT_DEPLOYED"
        if status in ("HEALTHY", "UPSCALING", "DOWNSCALING") and running > 0:
            self._started = True
        out = {"ready": self._started and running > 0, "workers": running, "status": status}
        self._ready_cache = (now, out)
        return out

    async def generate(self, request: GenerateRequest, chunk_hashes: list[int]) -> AsyncGenerator[GenerateDelta, None]:
        gen = getattr(self._handle, self._method).remote(request, chunk_hashes=chunk_hashes)
        finished = False
        try:
            async for delta in gen:
                if delta.finish_reason is not None:
                    finished = True
                yield delta
        except Exception as e:
            raise classify_remote_error(e) from None
        finally:
            if not finished:
                gen.cancel()


def classify_remote_error(e: Exception) -> Exception:
    """What a failure of a call to a worker replica means to the ingress.

    The worker's own typed `EngineError` (carried as a RayTaskError's cause) comes back as itself; a worker
    that died, is unreachable or could not be reached (an actor or node death, a lost object, back
    pressure, no replica; also when Ray wraps one of those in a RayTaskError) becomes `EngineDeadError`,
    which the ingress may retry on another worker; any other error of the worker becomes `EngineStepError`
    (a clean 500 with the error's type only). Errors that are not Ray's pass through unchanged."""
    chain: list[BaseException] = [e]  # e, its cause, the cause's cause... (RayTaskError(ActorDiedError))
    while isinstance(getattr(chain[-1], "cause", None), BaseException) and len(chain) < 8:
        chain.append(chain[-1].cause)  # type: ignore[attr-defined]
    for err in reversed(chain):  # the innermost first: the worker's own exception
        if isinstance(err, EngineError) and not _is_ray_error(err):
            return err
        if _worker_unavailable(err):
            return EngineDeadError(f"the worker is unavailable ({type(err).__name__})")
    err = chain[-1]
    if _is_ray_error(e):
        return EngineStepError(f"the worker failed ({type(err).__name__})")
    return e


# Engine error type -> (HTTP status, OpenAI error type, error code); the first matching row wins.
_ENGINE_ERRORS: tuple[tuple[type[EngineError], int, str, str | None], ...] = (
    (PromptTooLongError, 413, "invalid_request_error", "context_length_exceeded"),
    (KVPoolTooSmallError, 413, "invalid_request_error", "context_length_exceeded"),
    (PinRefusedError, 429, "rate_limit_error", "cache_pin_refused"),  # quota or pool share of pins used up
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


def _is_ray_error(e: BaseException) -> bool:
    return (type(e).__module__ or "").startswith("ray.")


def _worker_unavailable(e: BaseException) -> bool:
    """Whether a Ray/Serve error means the worker is gone or unreachable (Ray is loaded when it raised one)."""
    if not _is_ray_error(e):
        return False
    from ray import exceptions as rx
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    gone = (rx.RayActorError, rx.WorkerCrashedError, rx.NodeDiedError, rx.LocalRayletDiedError, rx.ObjectLostError,
            rx.RaySystemError, BackPressureError, DeploymentUnavailableError)
    return isinstance(e, gone)


async def next_delta(agen: AsyncIterator[GenerateDelta]) -> GenerateDelta | None:
    """The next (possibly coalesced) delta, or None at the end. An `EngineError` becomes the APIError its
    type maps to (`engine_error_to_api`)."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None
    except EngineError as e:
        raise engine_error_to_api(e) from None
