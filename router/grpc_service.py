"""The gRPC service ``chunkserve.v1.ChunkServe`` as methods of the ingress.

Ray Serve's gRPC proxy calls ``Generate(request, grpc_context)`` / ``GenerateStream(request, grpc_context)``
on the ingress deployment (``grpc_context`` is a ``RayServegRPCContext``). Errors set the status code and
details on the context (and ``retry-after`` trailing metadata for RESOURCE_EXHAUSTED); ``Generate`` then
returns an empty message, ``GenerateStream`` raises ``GrpcStatusError`` (Ray's proxy applies a streaming
call's status only from an exception). ``add_to_grpc_server`` serves the same methods from a plain ``grpc.aio`` server (tests, no Ray).

Requests arrive as raw bytes (``add_servicer_raw``, the ``grpc_servicer_functions`` entry of the app, registers
the methods with no request deserializer), so the ingress refuses a message over ``max_body_bytes`` before
parsing or tokenising it (INVALID_ARGUMENT, as HTTP's 413), and a message that does not parse gets
INVALID_ARGUMENT with a plain description (never a Python class name). A failure that is not the
client's fault is INTERNAL ("internal error"), UNAVAILABLE (no worker) with ``retry-after``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from pydantic import ValidationError

from chunkserve.router.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_to_api_error,
)
from chunkserve.router.write_watch import WriteWatch
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.v1 import generate_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from chunkserve.router.ingress import Ingress

logger = logging.getLogger(__name__)
SERVICE = "chunkserve.v1.ChunkServe"
SERVICER_FUNCTION = "chunkserve.router.grpc_service.add_servicer_raw"  # for Ray Serve's grpc_options

_GRPC_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,  # the client read nothing for the stream write timeout
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
# The status details travel as the grpc-message trailer, percent-encoded (up to 3 bytes a byte): a message that
# echoes a long input (a model name) overflowed the client's metadata limit (8-16 KiB), which then reported
# RESOURCE_EXHAUSTED instead of the status. Details are cut to this many UTF-8 bytes.
MAX_DETAILS_BYTES = 1024
# A client's request_id comes back in every message of its stream: unbounded, a 4 MB id made a 50-token stream
# send 20 MB (and a unary reply pass the client's 4 MB receive limit).
MAX_REQUEST_ID_CHARS = 256


def grpc_status(http_status: int) -> grpc.StatusCode:
    """The gRPC status code for an HTTP error status."""
    return _GRPC_CODES.get(http_status, grpc.StatusCode.INTERNAL)


class GrpcStatusError(Exception):
    """Raised by ``GenerateStream`` after setting the status on the context: Ray Serve's proxy sends a
    streaming call's user-set status only when the method raises (``add_to_grpc_server`` aborts with it)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: list[tuple[str, str]]) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing

    def __reduce__(self) -> tuple[Any, ...]:  # picklable: Ray ships it from the replica to the proxy
        return (GrpcStatusError, (self.code, self.details, self.trailing))


def short_details(message: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """``message`` cut to at most ``limit`` UTF-8 bytes (ending in "..." when cut)."""
    raw = message.encode("utf-8", "replace")  # a lone surrogate (from an exception's text) becomes "?"
    if len(raw) <= limit:
        return raw.decode()
    return raw[:limit - 3].decode("utf-8", "ignore") + "..."


def _set_error(context: Any, e: APIError) -> GrpcStatusError:
    code = grpc_status(e.status)
    details = short_details(e.message)
    trailing = []
    if "Retry-After" in e.headers:
        trailing = [("retry-after", e.headers["Retry-After"])]
        details = f"{details}; retry after {e.headers['Retry-After']} s"
        context.set_trailing_metadata(trailing)
    context.set_code(code)
    context.set_details(details)
    return GrpcStatusError(code, details, trailing)


def parse_message(msg: bytes | pb.GenerateRequest, limit: int) -> pb.GenerateRequest:
    """The request message from raw bytes (or an already parsed one), refused before parsing when it is
    over ``limit`` bytes (APIError 413) and with a plain 400 when it is not a GenerateRequest."""
    if isinstance(msg, bytes | bytearray | memoryview):
        size = len(msg)
        if size > limit:
            raise APIError(413, f"request message of {size} bytes exceeds the limit of {limit}",
                           code="request_too_large")
        try:
            return pb.GenerateRequest.FromString(bytes(msg))
        except (DecodeError, ValueError):
            raise APIError(400, "the request is not a valid chunkserve.v1.GenerateRequest message",
                           code="invalid_message") from None
    if not isinstance(msg, pb.GenerateRequest):
        raise APIError(400, "the request is not a chunkserve.v1.GenerateRequest message", code="invalid_message")
    if msg.ByteSize() > limit:
        raise APIError(413, f"request message of {msg.ByteSize()} bytes exceeds the limit of {limit}",
                       code="request_too_large")
    return msg


def to_openai_request(ingress: Ingress, msg: pb.GenerateRequest, stream: bool
                      ) -> CompletionRequest | ChatCompletionRequest:
    """The proto request as a validated OpenAI request (raises APIError 400 for bad input)."""
    has_prompt = msg.HasField("prompt")
    kinds = int(has_prompt) + int(len(msg.messages) > 0) + int(len(msg.prompt_token_ids) > 0)
    if kinds != 1:
        raise APIError(400, "set exactly one of prompt, messages or prompt_token_ids", param="prompt")
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
        raise APIError(400, f"request_id has {len(msg.request_id)} characters; at most {MAX_REQUEST_ID_CHARS} "
                            f"are allowed", param="request_id")
    ctx = ingress.config.max_model_len  # each message costs a token at least: refused before validating them
    if len(msg.messages) > ctx:
        raise APIError(413, f"the request has {len(msg.messages)} messages; this model's context of {ctx} tokens "
                       f"cannot hold them", code="context_length_exceeded")
    s = msg.sampling
    fields: dict[str, Any] = {"model": msg.model or ingress.config.model_name, "stream": stream}
    if s.HasField("max_tokens"):
        fields["max_tokens"] = s.max_tokens
    if s.HasField("temperature"):
        fields["temperature"] = s.temperature
    if s.HasField("top_p"):
        fields["top_p"] = s.top_p
    if s.HasField("top_k"):
        fields["top_k"] = s.top_k
    if s.HasField("seed"):
        fields["seed"] = s.seed
    if len(s.stop):
        fields["stop"] = list(s.stop)
    if s.HasField("ignore_eos"):
        fields["ignore_eos"] = s.ignore_eos
    if msg.user:
        fields["user"] = msg.user
    try:
        if len(msg.messages):
            fields["messages"] = [_message(m) for m in msg.messages]
            return ChatCompletionRequest.model_validate(fields)
        fields["prompt"] = msg.prompt if has_prompt else list(msg.prompt_token_ids)
        return CompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_to_api_error(e.errors(include_url=False)) from None


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.HasField("cache_control"):  # validated by ChatCompletionRequest (a bad type or ttl is a 400)
        out["cache_control"] = {"type": m.cache_control.type, "ttl": m.cache_control.ttl or "5m"}
    return out


def _usage(d: Any) -> pb.Usage:
    return pb.Usage(prompt_tokens=d.num_prompt_tokens, completion_tokens=d.num_output_tokens,
                    total_tokens=d.num_prompt_tokens + d.num_output_tokens, cached_tokens=d.num_cached_tokens,
                    cache_creation_tokens=getattr(d, "num_cache_creation_tokens", 0))


class GrpcServiceMixin:
    """``Generate`` and ``GenerateStream`` for an ``Ingress`` (mixed into it)."""

    async def _grpc_prepare(self: Any, raw: bytes | pb.GenerateRequest, grpc_context: Any, stream: bool
                            ) -> tuple[pb.GenerateRequest, Any]:
        received = time.time()
        tenant = self.authenticate_metadata(grpc_context.invocation_metadata())
        lease = await self.admit(tenant)  # before parsing: as over HTTP (`http_app._prepared`)
        try:
            request = parse_message(raw, self.config.max_body_bytes)
            req = to_openai_request(self, request, stream)
        except BaseException:
            await lease.finish()
            raise
        return request, await self.prepare(tenant, req, self.new_request_id("grpc"), received, lease)

    async def Generate(self: Any, request: bytes | pb.GenerateRequest, grpc_context: Any) -> pb.GenerateResponse:
        """Unary generate: the whole completion and its usage."""
        try:
            request, prep = await self._grpc_prepare(request, grpc_context, stream=False)
            text, tokens, last = await self.collect(prep)
        except APIError as e:
            self.metrics.error(e.status)
            _set_error(grpc_context, e)
            return pb.GenerateResponse()
        except Exception:
            logger.exception("gRPC Generate failed")
            self.metrics.error(500)
            _set_error(grpc_context, APIError(500, "internal error", "server_error"))
            return pb.GenerateResponse()
        return pb.GenerateResponse(request_id=request.request_id or prep.request.request_id, model=prep.model,
                                   text=text, token_ids=tokens, finish_reason=last.finish_reason or "",
                                   usage=_usage(last))

    async def GenerateStream(self: Any, request: bytes | pb.GenerateRequest, grpc_context: Any
                             ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        """Server-streaming generate: text/token deltas; the last message has finish_reason and usage.
        Cancelling the call closes this generator, which aborts the request and frees its KV chunks."""
        try:
            request, prep = await self._grpc_prepare(request, grpc_context, stream=True)
        except APIError as e:
            self.metrics.error(e.status)
            raise _set_error(grpc_context, e) from None
        except Exception:  # as in Generate: INTERNAL "internal error", never a class name
            logger.exception("gRPC GenerateStream failed before its first message")
            self.metrics.error(500)
            raise _set_error(grpc_context, APIError(500, "internal error", "server_error")) from None
        rid = request.request_id or prep.request.request_id
        last = None
        limit = self.config.stream_write_timeout_s
        watch = WriteWatch(limit) if limit is not None else None
        s = self.stream(prep)
        # a client that reads nothing: the guard closes the engine stream under this (suspended) generator
        guard = asyncio.get_running_loop().create_task(_close_when_stalled(watch, s)) if watch else None
        try:
            async for d in s:
                last = d
                if d.finish_reason == "abort":  # ended, not finished: UNAVAILABLE below, no finished message
                    break
                done = d.finish_reason is not None
                if d.token_ids or done:
                    msg = pb.GenerateStreamResponse(
                        request_id=rid, text=d.text, token_ids=d.token_ids,
                        finish_reason=d.finish_reason or "", usage=_usage(d) if done else None)
                    if watch is not None:
                        watch.begin()
                    yield msg
                    if watch is not None:
                        watch.end()
                        if watch.fired:  # the client read again just as the guard gave up on it
                            break
            if watch is not None and watch.fired:
                raise APIError(408, f"the client read nothing for {watch.limit_s:.0f} s: its stream was ended",
                               code="stream_write_timeout")
        except APIError as e:
            self.metrics.error(e.status)
            raise _set_error(grpc_context, e) from None
        except Exception:
            logger.exception("gRPC GenerateStream failed")
            self.metrics.error(500)
            raise _set_error(grpc_context, APIError(500, "internal error", "server_error")) from None
        finally:  # the engine stream is closed once: by the guard once it fired, else here
            if guard is not None and watch is not None and watch.fired:
                await guard
            else:
                if guard is not None:
                    guard.cancel()
                await s.aclose()
        if last is None or last.finish_reason in (None, "abort"):
            err = self.unavailable("the engine ended the request before it finished", code="engine_aborted")
            self.metrics.error(err.status)
            raise _set_error(grpc_context, err)


async def _close_when_stalled(watch: WriteWatch, stream: AsyncGenerator[Any, None]) -> None:
    """Once a message has waited ``watch.limit_s`` for the client, closes the engine stream (suspended at its
    yield while the service's generator waits on the client): the request is aborted and its KV chunks, admission
    slot and lease are freed, even if the client never reads again."""
    await watch.stalled()
    logger.warning("gRPC client read nothing for %.0f s: its stream is aborted", watch.limit_s)
    try:
        await stream.aclose()
    except Exception:  # the stream's own cleanup failed: logged, the service's generator still ends cleanly
        logger.exception("closing a stalled gRPC stream failed")


class _AioServicer(pb_grpc.ChunkServeServicer):
    """Adapts a ``grpc.aio`` server to the ingress methods (the context API is the same)."""

    def __init__(self, ingress: Ingress) -> None:
        self._ingress = ingress

    async def Generate(self, request: bytes, context: Any) -> pb.GenerateResponse:
        return await self._ingress.Generate(request, context)

    async def GenerateStream(self, request: bytes, context: Any
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            async with aclosing(self._ingress.GenerateStream(request, context)) as gen:
                async for item in gen:
                    yield item
        except GrpcStatusError as e:
            await context.abort(e.code, e.details, tuple(e.trailing))


def add_servicer_raw(servicer: Any, server: Any) -> None:
    """Registers ``chunkserve.v1.ChunkServe`` on ``server`` with raw-bytes requests (no deserializer): the
    ``grpc_servicer_functions`` entry for Ray Serve's gRPC proxy, which hands the bytes to the ingress."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=None,
            response_serializer=pb.GenerateStreamResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:
        register(SERVICE, handlers)


def add_to_grpc_server(ingress: Ingress, server: grpc.aio.Server) -> None:
    """Serves the ingress's gRPC methods from a ``grpc.aio`` server (outside Ray Serve)."""
    add_servicer_raw(_AioServicer(ingress), server)
