"""The gRPC service ``chunkserve.v1.ChunkServe`` as methods of the ingress.

Ray Serve's gRPC proxy calls ``Generate(request, grpc_context)`` / ``GenerateStream(request, grpc_context)``
on the ingress deployment (``grpc_context`` is a ``RayServegRPCContext``). Errors set the status code and
details on the context (and ``retry-after`` trailing metadata for RESOURCE_EXHAUSTED); ``Generate`` then
returns an empty message, ``GenerateStream`` raises ``GrpcStatusError`` (Ray's proxy applies a streaming
call's status only from an exception). ``add_to_grpc_server`` serves the same methods from a plain ``grpc.aio`` server (tests, no Ray).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc
from pydantic import ValidationError

from chunkserve.router.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_to_api_error,
)
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.v1 import generate_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from chunkserve.router.ingress import Ingress

_GRPC_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


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


def _set_error(context: Any, e: APIError) -> GrpcStatusError:
    code = grpc_status(e.status)
    details = e.message
    trailing = []
    if "Retry-After" in e.headers:
        trailing = [("retry-after", e.headers["Retry-After"])]
        details = f"{details}; retry after {e.headers['Retry-After']} s"
        context.set_trailing_metadata(trailing)
    context.set_code(code)
    context.set_details(details)
    return GrpcStatusError(code, details, trailing)


def to_openai_request(ingress: Ingress, msg: pb.GenerateRequest, stream: bool
                      ) -> CompletionRequest | ChatCompletionRequest:
    """The proto request as a validated OpenAI request (raises APIError 400 for bad input)."""
    has_prompt = msg.HasField("prompt")
    kinds = int(has_prompt) + int(len(msg.messages) > 0) + int(len(msg.prompt_token_ids) > 0)
    if kinds != 1:
        raise APIError(400, "set exactly one of prompt, messages or prompt_token_ids", param="prompt")
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
    if msg.user:
        fields["user"] = msg.user
    try:
        if len(msg.messages):
            fields["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages]
            return ChatCompletionRequest.model_validate(fields)
        fields["prompt"] = msg.prompt if has_prompt else list(msg.prompt_token_ids)
        return CompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_to_api_error(e.errors(include_url=False)) from None


def _usage(d: Any) -> pb.Usage:
    return pb.Usage(prompt_tokens=d.num_prompt_tokens, completion_tokens=d.num_output_tokens,
                    total_tokens=d.num_prompt_tokens + d.num_output_tokens, cached_tokens=d.num_cached_tokens)


class GrpcServiceMixin:
    """``Generate`` and ``GenerateStream`` for an ``Ingress`` (mixed into it)."""

    async def _grpc_prepare(self: Any, request: pb.GenerateRequest, grpc_context: Any, stream: bool) -> Any:
        tenant = self.authenticate_metadata(grpc_context.invocation_metadata())
        req = to_openai_request(self, request, stream)
        return await self.prepare(tenant, req, self.new_request_id("grpc"))

    async def Generate(self: Any, request: pb.GenerateRequest, grpc_context: Any) -> pb.GenerateResponse:
        """Unary generate: the whole completion and its usage."""
        try:
            prep = await self._grpc_prepare(request, grpc_context, stream=False)
            text, tokens, last = await self.collect(prep)
        except APIError as e:
            self.metrics.error(e.status)
            _set_error(grpc_context, e)
            return pb.GenerateResponse()
        return pb.GenerateResponse(request_id=request.request_id or prep.request.request_id, model=prep.model,
                                   text=text, token_ids=tokens, finish_reason=last.finish_reason or "",
                                   usage=_usage(last))

    async def GenerateStream(self: Any, request: pb.GenerateRequest, grpc_context: Any
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Server-streaming generate: text/token deltas; the last message has finish_reason and usage.
        Cancelling the call closes this generator, which aborts the request and frees its KV chunks."""
        try:
            prep = await self._grpc_prepare(request, grpc_context, stream=True)
        except APIError as e:
            self.metrics.error(e.status)
            raise _set_error(grpc_context, e) from None
        rid = request.request_id or prep.request.request_id
        last = None
        try:
            async with aclosing(self.stream(prep)) as s:
                async for d in s:
                    last = d
                    done = d.finish_reason is not None
                    if d.token_ids or done:
                        yield pb.GenerateStreamResponse(
                            request_id=rid, text=d.text, token_ids=d.token_ids,
                            finish_reason=d.finish_reason or "", usage=_usage(d) if done else None)
        except APIError as e:
            self.metrics.error(e.status)
            raise _set_error(grpc_context, e) from None
        if last is None or last.finish_reason in (None, "abort"):
            e = APIError(503, "the engine ended the request before it finished", "server_error")
            raise _set_error(grpc_context, e)


class _AioServicer(pb_grpc.ChunkServeServicer):
    """Adapts a ``grpc.aio`` server to the ingress methods (the context API is the same)."""

    def __init__(self, ingress: Ingress) -> None:
        self._ingress = ingress

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        return await self._ingress.Generate(request, context)

    async def GenerateStream(self, request: pb.GenerateRequest, context: Any
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            async with aclosing(self._ingress.GenerateStream(request, context)) as gen:
                async for item in gen:
                    yield item
        except GrpcStatusError as e:
            await context.abort(e.code, e.details, tuple(e.trailing))


def add_to_grpc_server(ingress: Ingress, server: grpc.aio.Server) -> None:
    """Serves the ingress's gRPC methods from a ``grpc.aio`` server (outside Ray Serve)."""
    pb_grpc.add_ChunkServeServicer_to_server(_AioServicer(ingress), server)
