"""The OpenAI-compatible FastAPI app over an ``Ingress``: routes, SSE streaming and error JSON.

Every error is OpenAI error JSON; bad input never yields a 500. A client that disconnects mid-stream
closes the body iterator, which closes the engine generator and so frees the request's KV chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from chunkserve.router.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    models_response,
    parse_request,
    sse,
    usage_of,
    validation_to_api_error,
)
from chunkserve.router.tenants import AuthError, one_authorization
from chunkserve.router.write_watch import WriteWatch

if TYPE_CHECKING:
    from chunkserve.router.ingress import Ingress
    from chunkserve.router.ingress_config import Prepared

logger = logging.getLogger(__name__)
Req = TypeVar("Req", CompletionRequest, ChatCompletionRequest)


class AbortOnDisconnectStreamingResponse(StreamingResponse):
    """Streams the body while watching for the client's disconnect; either way the body iterator is
    closed (shielded from cancellation), so the request behind it is aborted at once. A client that stops
    reading (its socket's buffers full, so one write waits) for ``write_timeout_s`` (found within a quarter of it
    more) is treated as gone too: otherwise it would hold its admission slot and KV chunks for as long as it kept
    the connection open."""

    def __init__(self, *args: Any, write_timeout_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = WriteWatch(self.write_timeout_s) if self.write_timeout_s is not None else None
        sender: Send = send
        if watch is not None:
            stamps = watch

            async def timed_send(message: Any) -> None:  # a stamp per write: no timer armed on the hot path
                stamps.begin()
                try:
                    await send(message)
                finally:
                    stamps.end()

            sender = timed_send

        try:
            async with anyio.create_task_group() as tg:

                async def _stream() -> None:
                    try:
                        await self.stream_response(sender)
                    except OSError:  # the client went away while we were sending
                        pass
                    except Exception:
                        logger.exception("streaming response failed")
                    tg.cancel_scope.cancel()

                async def _watch_writes(w: WriteWatch) -> None:
                    await w.stalled()
                    logger.warning("client read nothing for %.0f s: its stream is aborted", w.limit_s)
                    tg.cancel_scope.cancel()

                tg.start_soon(_stream)
                if watch is not None:
                    tg.start_soon(_watch_writes, watch)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(ingress: Ingress) -> FastAPI:
    """The FastAPI app serving /v1/models, /v1/completions, /v1/chat/completions, /health, /ready, /metrics."""
    app = FastAPI(title="chunkserve", version="1", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        ingress.metrics.error(exc.status)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        ingress.metrics.error(400)
        return _error_response(validation_to_api_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        ingress.metrics.error(exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        ingress.metrics.error(499)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        ingress.metrics.error(500)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    from chunkserve.router.dashboard import dashboard_router

    app.include_router(dashboard_router(ingress))  # /dashboard and /dashboard/api/state

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}  # liveness: the ingress answers (see /ready for the workers)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        state = await ingress.engine.readiness()
        return JSONResponse(state, status_code=200 if state.get("ready") else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not ingress.tenants.is_admin(_authorization(request)):
            raise APIError(403, "/metrics needs an admin key in tenant mode (admin_api_key_sha256 in the "
                                "tenants file): send 'Authorization: Bearer <admin key>'",
                           type="permission_error", code="admin_key_required")
        await ingress.refresh_metrics()
        return Response(ingress.metrics.render(), media_type=ingress.metrics.content_type)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        ingress.authenticate(_authorization(request))
        return models_response([ingress.config.model_name], ingress.created)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        ingress.authenticate(_authorization(request))
        ingress.check_model(model_id)
        return models_response([model_id], ingress.created)["data"][0]

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        received = time.time()
        req, prep = await _prepared(ingress, request, CompletionRequest, "cmpl", received)
        if req.stream:
            return await _start_stream(request, ingress, prep, _completion_events(ingress, prep))
        text, _tokens, last = await _unless_disconnected(request, ingress.collect(prep))
        usage = usage_of(last)
        return JSONResponse(completion_response(prep.request.request_id, prep.model, prep.created, text,
                                                last.finish_reason, usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = time.time()
        req, prep = await _prepared(ingress, request, ChatCompletionRequest, "chatcmpl", received)
        if req.stream:
            return await _start_stream(request, ingress, prep, _chat_events(ingress, prep))
        text, _tokens, last = await _unless_disconnected(request, ingress.collect(prep))
        usage = usage_of(last)
        return JSONResponse(chat_response(prep.request.request_id, prep.model, prep.created, text,
                                          last.finish_reason, usage))

    return app


def _authorization(request: Request) -> str | None:
    """The request's one Authorization value (401 for several: `tenants.one_authorization`)."""
    try:
        return one_authorization(request.headers.getlist("authorization"))
    except AuthError as e:
        raise APIError(401, str(e), type="authentication_error", code="invalid_api_key") from None


async def _prepared(ingress: Ingress, request: Request, cls: type[Req], prefix: str, received: float
                    ) -> tuple[Req, Prepared]:
    """Authentication and admission, then the body read and parsed (so a tenant over its limits costs no
    parsing, and a malformed request counts against them), then `Ingress.prepare`."""
    tenant = ingress.authenticate(_authorization(request))
    lease = await ingress.admit(tenant)
    try:
        limit = ingress.config.max_body_bytes
        req = parse_request(await _read_body(request, limit), cls, limit, ingress.config.max_model_len)
    except BaseException:
        await lease.finish()
        raise
    return req, await ingress.prepare(tenant, req, ingress.new_request_id(prefix), received, lease)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes (by its
    Content-Length or while reading), so an oversized upload is never buffered whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                       code="request_too_large")
    buf = bytearray()
    try:
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    except ClientDisconnect:  # gone mid-upload: a 499 as any client that left, not a 500
        raise ClientDisconnected() from None
    return bytes(buf)


class ClientDisconnected(Exception):
    """The client went away before its response was ready (while sending its body, or waiting for the answer)."""


async def _watch_disconnect(request: Request) -> None:
    """Returns once the client has gone (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a server whose receive() never blocks must not spin the loop


async def _unless_disconnected(request: Request, aw: Awaitable[Any]) -> Any:
    """``aw``'s result while the client stays; a disconnect first cancels it (which aborts the request in the
    engine and frees its KV chunks) and raises `ClientDisconnected`."""
    work = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()  # closes the engine stream: the request is aborted
            await asyncio.wait({work})
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _start_stream(request: Request, ingress: Ingress, prep: Prepared, events: AsyncIterator[bytes]
                        ) -> Response:
    """Waits for the first event so that errors before the first token still get a proper status code,
    then streams the rest as SSE. A client that leaves before the first event (a queued request it gave up
    on) aborts the request, as a non-streaming one does."""
    try:
        first = await _unless_disconnected(request, events.__anext__())
    except StopAsyncIteration:
        first = b""
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise

    async def body() -> AsyncIterator[bytes]:
        async with aclosing(events):  # type: ignore[type-var]
            if first:
                yield first
            async for ev in events:
                yield ev

    return AbortOnDisconnectStreamingResponse(body(), media_type="text/event-stream",
                                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                              write_timeout_s=ingress.config.stream_write_timeout_s)


async def _events(ingress: Ingress, prep: Prepared, kind: str) -> AsyncIterator[bytes]:
    """The SSE events of one request. An error before the first event is raised (a proper status code);
    after it, the stream carries an error event and ends with [DONE] (never a cut stream)."""
    rid, model, created = prep.request.request_id, prep.model, prep.created
    last = None
    sent = False
    try:
        async with aclosing(ingress.stream(prep)) as stream:
            async for d in stream:
                if d.finish_reason == "abort":  # ended, not finished: the error below, never a "stop" chunk
                    last = d
                    break
                if kind == "chat" and last is None:
                    sent = True
                    yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                         null_usage=prep.include_usage))
                last = d
                if d.text or d.finish_reason is not None:
                    sent = True
                    if kind == "chat":
                        delta = {"content": d.text} if d.text else {}
                        yield sse(chat_chunk(rid, model, created, delta, d.finish_reason,
                                             null_usage=prep.include_usage))
                    else:
                        yield sse(completion_chunk(rid, model, created, d.text, d.finish_reason,
                                                   null_usage=prep.include_usage))
    except APIError as e:
        if not sent:
            raise
        ingress.metrics.error(e.status)  # before the first event the exception handler counts it
        yield sse(e.body())
        yield sse("[DONE]")
        return
    except Exception:  # a bug, not the client's input: still a clean end of the stream
        if not sent:
            raise
        logger.exception("stream %s failed", rid)
        ingress.metrics.error(500)
        yield sse(error_body("internal server error", "server_error"))
        yield sse("[DONE]")
        return
    if last is None or last.finish_reason in (None, "abort"):
        err = ingress.unavailable("the engine ended the request before it finished", code="engine_aborted")
        if not sent:
            raise err
        ingress.metrics.error(err.status)
        yield sse(err.body())
    elif prep.include_usage:
        usage = usage_of(last)
        if kind == "chat":
            yield sse(chat_chunk(rid, model, created, None, usage=usage))
        else:
            yield sse(completion_chunk(rid, model, created, None, usage=usage))
    yield sse("[DONE]")


def _chat_events(ingress: Ingress, prep: Prepared) -> AsyncIterator[bytes]:
    return _events(ingress, prep, "chat")


def _completion_events(ingress: Ingress, prep: Prepared) -> AsyncIterator[bytes]:
    return _events(ingress, prep, "completion")
