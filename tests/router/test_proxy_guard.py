"""`ProxyGuard` (the middleware in Ray Serve's HTTP proxy) against stand-in proxy apps: a request whose
ingress replica died gets a 503 JSON or an SSE error event and [DONE], the proxy's plain-text 404 for an API
route becomes a 503, and everything the app answers in full passes through untouched."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from chunkserve.router.proxy_guard import ProxyGuard, proxy_middlewares

Message = dict[str, Any]


def _call(app: Any, path: str = "/v1/completions") -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(m: Message) -> None:
        sent.append(dict(m))

    asyncio.run(ProxyGuard(app)({"type": "http", "path": path}, receive, send))
    return sent


def _start(status: int, ctype: bytes) -> Message:
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]}


def _headers(m: Message) -> dict[bytes, bytes]:
    return {bytes(k): bytes(v) for k, v in m["headers"]}


def test_an_app_that_ends_without_answering_gives_503_json_with_retry_after() -> None:
    async def dead(scope: Any, receive: Any, send: Any) -> None:
        return None  # what Ray's proxy does when the ingress replica died before answering

    sent = _call(dead)
    assert sent[0]["status"] == 503 and _headers(sent[0])[b"retry-after"] == b"2"
    assert json.loads(sent[1]["body"])["error"]["code"] == "ingress_lost"
    assert len(sent) == 2 and sent[1]["more_body"] is False


def test_an_app_that_raises_before_answering_gives_503_json() -> None:
    async def boom(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("actor died")

    sent = _call(boom)
    assert sent[0]["status"] == 503 and _headers(sent[0])[b"content-type"] == b"application/json"


def test_a_cut_event_stream_ends_with_an_error_event_and_done() -> None:
    async def cut(scope: Any, receive: Any, send: Any) -> None:
        await send(_start(200, b"text/event-stream; charset=utf-8"))
        await send({"type": "http.response.body", "body": b"data: {\"choices\": []}\n\n", "more_body": True})

    sent = _call(cut)
    assert sent[0]["status"] == 200 and len(sent) == 3
    tail = sent[2]["body"].decode()
    events = [line[len("data: "):] for line in tail.split("\n") if line.startswith("data: ")]
    assert json.loads(events[0])["error"]["type"] == "service_unavailable"
    assert events[-1] == "[DONE]" and sent[2]["more_body"] is False


def test_the_proxys_plain_text_404_on_an_api_route_becomes_503() -> None:
    async def not_found(scope: Any, receive: Any, send: Any) -> None:
        await send(_start(404, b"text/plain; charset=utf-8"))
        await send({"type": "http.response.body", "body": b"Path '/v1/completions' not found.", "more_body": False})

    sent = _call(not_found)
    assert [m["status"] for m in sent if "status" in m] == [503]
    assert json.loads(sent[1]["body"])["error"]["code"] == "not_deployed" and len(sent) == 2


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/dashboard"])
def test_complete_answers_pass_through_unchanged(path: str) -> None:
    body = b'{"error": {"message": "model not found"}}'

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(_start(404, b"application/json"))  # the ingress's own JSON 404: kept
        await send({"type": "http.response.body", "body": body, "more_body": False})

    sent = _call(app, path)
    assert sent[0]["status"] == 404 and sent[1]["body"] == body and len(sent) == 2


def test_routes_outside_the_api_are_not_guarded() -> None:
    async def dead(scope: Any, receive: Any, send: Any) -> None:
        return None

    assert _call(dead, "/-/routes") == []


def test_a_client_disconnect_is_not_answered() -> None:
    async def cancelled(scope: Any, receive: Any, send: Any) -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        _call(cancelled)


def test_the_callback_gives_ray_one_starlette_middleware() -> None:
    (mw,) = proxy_middlewares()
    assert mw.cls is ProxyGuard
