"""Small clients for a chunkserve server: HTTP (OpenAI API) and gRPC (``chunkserve.v1``), with API keys.

    from chunkserve.client import HTTPClient, GrpcClient
    http = HTTPClient("http://127.0.0.1:8000", api_key="sk-...")
    out = http.chat([{"role": "user", "content": "Hi"}], max_tokens=16)
    for chunk in http.chat([...], stream=True):       # SSE chunks as dicts
        ...
    rpc = GrpcClient("127.0.0.1:9000", api_key="sk-...")
    resp = rpc.generate(prompt="Hello", max_tokens=16)  # GenerateResponse with .usage.cached_tokens
    for piece in rpc.generate_stream(messages=[{"role": "user", "content": "Hi"}]):
        ...

The HTTP client uses only the standard library; the official ``openai`` package works as well.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from chunkserve.v1 import generate_pb2 as pb
from chunkserve.v1 import generate_pb2_grpc as pb_grpc

__all__ = ["AsyncGrpcClient", "ChunkServeError", "GrpcClient", "HTTPClient", "build_request"]


class ChunkServeError(Exception):
    """An error answer: HTTP status (or gRPC code name), message, and Retry-After seconds when given."""

    def __init__(self, status: int | str, message: str, type: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.retry_after = retry_after


class HTTPClient:
    """The OpenAI-compatible HTTP API. ``model=None`` asks /v1/models for the served model once."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._model = model

    def _open(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                err = {"message": raw.decode("utf-8", "replace")}
            ra = e.headers.get("Retry-After")
            raise ChunkServeError(e.code, err.get("message", ""), err.get("type"), err.get("code"),
                                  float(ra) if ra else None) from None

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        with self._open(method, path, body) as resp:
            return json.loads(resp.read())

    def _sse(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._open("POST", path, body) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event:
                    err = event["error"]
                    raise ChunkServeError("stream", err.get("message", ""), err.get("type"), err.get("code"))
                yield event

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.models()[0]
        return self._model

    def models(self) -> list[str]:
        return [m["id"] for m in self._json("GET", "/v1/models")["data"]]

    def health(self) -> bool:
        try:
            return self._json("GET", "/health").get("status") == "ok"
        except (OSError, ChunkServeError):
            return False

    def metrics(self) -> str:
        with self._open("GET", "/metrics") as resp:
            return resp.read().decode()

    def complete(self, prompt: str | list[int], stream: bool = False, **params: Any) -> Any:
        """/v1/completions: the response dict, or an iterator of chunk dicts when ``stream``."""
        body = {"model": params.pop("model", None) or self.model, "prompt": prompt, **params}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            return self._sse("/v1/completions", body)
        return self._json("POST", "/v1/completions", body)

    def chat(self, messages: Sequence[dict[str, Any]], stream: bool = False, **params: Any) -> Any:
        """/v1/chat/completions: the response dict, or an iterator of chunk dicts when ``stream``
        (the last chunk carries ``usage``)."""
        body = {"model": params.pop("model", None) or self.model, "messages": list(messages), **params}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            return self._sse("/v1/chat/completions", body)
        return self._json("POST", "/v1/chat/completions", body)


def build_request(prompt: str | None = None, messages: Sequence[dict[str, str]] | None = None,
                  prompt_token_ids: Sequence[int] | None = None, model: str = "",
                  max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, seed: int | None = None, stop: Sequence[str] | str = (),
                  user: str = "", request_id: str = "", ignore_eos: bool | None = None) -> pb.GenerateRequest:
    """A ``chunkserve.v1.GenerateRequest`` (give exactly one of prompt, messages, prompt_token_ids)."""
    sp = pb.SamplingParams(stop=[stop] if isinstance(stop, str) else list(stop))
    for name, v in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                    ("top_k", top_k), ("seed", seed), ("ignore_eos", ignore_eos)):
        if v is not None:
            setattr(sp, name, v)
    req = pb.GenerateRequest(model=model, sampling=sp, user=user, request_id=request_id,
                             messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                       for m in (messages or ())],
                             prompt_token_ids=list(prompt_token_ids or ()))
    if prompt is not None:
        req.prompt = prompt
    return req


def _metadata(api_key: str | None, application: str | None) -> list[tuple[str, str]]:
    md = []
    if api_key:
        md.append(("authorization", f"Bearer {api_key}"))
    if application:
        md.append(("application", application))
    return md


def _rpc_error(e: grpc.RpcError) -> ChunkServeError:
    code = e.code() if hasattr(e, "code") else None
    ra = None
    for k, v in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if k == "retry-after":
            ra = float(v)
    return ChunkServeError(code.name if code else "UNKNOWN", e.details() if hasattr(e, "details") else str(e),
                           retry_after=ra)


class GrpcClient:
    """The ``chunkserve.v1.ChunkServe`` service over a blocking channel. ``application`` names the
    Serve app when more than one runs. Errors raise ChunkServeError with the gRPC code's name."""

    def __init__(self, target: str = "127.0.0.1:9000", api_key: str | None = None,
                 application: str | None = None, timeout: float | None = 600.0) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.ChunkServeStub(self._channel)
        self._md = _metadata(api_key, application)
        self.timeout = timeout

    def generate(self, **kwargs: Any) -> pb.GenerateResponse:
        """Unary generate; kwargs as ``build_request``."""
        try:
            return self._stub.Generate(build_request(**kwargs), metadata=self._md, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e) from None

    def generate_stream(self, **kwargs: Any) -> Iterator[pb.GenerateStreamResponse]:
        """Server-streaming generate; stop iterating (or ``close()`` it) to cancel the request."""
        call = self._stub.GenerateStream(build_request(**kwargs), metadata=self._md, timeout=self.timeout)
        try:
            yield from call
        except grpc.RpcError as e:
            raise _rpc_error(e) from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGrpcClient:
    """``GrpcClient`` over ``grpc.aio`` (create and use it inside one event loop)."""

    def __init__(self, target: str = "127.0.0.1:9000", api_key: str | None = None,
                 application: str | None = None, timeout: float | None = 600.0) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.ChunkServeStub(self._channel)
        self._md = _metadata(api_key, application)
        self.timeout = timeout

    async def generate(self, **kwargs: Any) -> pb.GenerateResponse:
        try:
            return await self._stub.Generate(build_request(**kwargs), metadata=self._md, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e) from None

    async def generate_stream(self, **kwargs: Any) -> AsyncIterator[pb.GenerateStreamResponse]:
        call = self._stub.GenerateStream(build_request(**kwargs), metadata=self._md, timeout=self.timeout)
        try:
            async for item in call:
                yield item
        except grpc.RpcError as e:
            raise _rpc_error(e) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()
