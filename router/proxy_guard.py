"""An ASGI middleware for Ray Serve's HTTP proxy: clean answers when the ingress cannot give one.

Ray's proxy holds each client connection and streams the ingress replica's answer. When that replica dies
(SIGKILL, OOM, node loss) the proxy has no answer to send: it ends without a response (uvicorn then sends a
plain-text 500) or cuts a stream already under way; and while the app is being deleted or redeployed (the drain
of `chunkserve up`) it answers the API routes with a plain-text 404. Every chunkserve route answers JSON, so
``ProxyGuard`` (in the proxy, around Ray's own ASGI app, on the ``/v1/`` routes) turns those into what the
ingress itself sends when no worker can take a request:

- nothing sent yet: HTTP 503 with an OpenAI error JSON and ``Retry-After``;
- an SSE stream cut before its ``[DONE]``: an error event, then ``[DONE]``;
- the proxy's own plain-text 404 for an API route (no app deployed there now): 503 as above.

Ray loads it through ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=chunkserve.router.proxy_guard.proxy_middlewares``
in the proxy's environment (`chunkserve up` sets it; see docs/reliability.md for `serve deploy`). This module
imports nothing heavy: it runs inside every proxy actor.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "chunkserve.router.proxy_guard.proxy_middlewares"
API_PREFIX = "/v1/"


def _error_json(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": code}}).encode()


class _Response:
    """What the wrapped app has sent on one request so far."""

    def __init__(self) -> None:
        self.started = False  # http.response.start forwarded
        self.ended = False  # the last body message (more_body false) forwarded
        self.sse = False
        self.swallow = False  # the app's response is replaced (the proxy's plain-text 404)


def _header(message: Message, name: bytes) -> bytes:
    for k, v in message.get("headers", []):
        if bytes(k).lower() == name:
            return bytes(v)
    return b""


class ProxyGuard:
    """ASGI middleware: see the module docstring. ``retry_after_s`` goes into every 503 it sends."""

    def __init__(self, app: ASGIApp, retry_after_s: int = 2) -> None:
        self.app = app
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or not str(scope.get("path", "")).startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        resp = _Response()

        async def guarded_send(message: Message) -> None:
            kind = message.get("type")
            if kind == "http.response.start":
                ctype = _header(message, b"content-type")
                if message.get("status") == 404 and ctype.startswith(b"text/plain"):
                    resp.swallow = True  # Ray's "Path ... not found": no app there now
                    await self._unavailable(send, resp, "no chunkserve app is serving this route now "
                                                        "(it is starting, being redeployed or shutting down)",
                                            "not_deployed")
                    return
                resp.sse = ctype.startswith(b"text/event-stream")
                resp.started = True
            elif resp.swallow:
                return
            elif kind == "http.response.body" and not message.get("more_body", False):
                resp.ended = True
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except asyncio.CancelledError:
            raise
        except Exception:  # Ray's proxy raised instead of answering: the replica is gone
            logger.warning("the proxy's app failed on %s", scope.get("path"), exc_info=True)
        if resp.ended or resp.swallow:
            return
        try:
            await self._repair(send, resp)
        except Exception:  # the client is gone as well: nothing left to tell it
            logger.debug("could not repair the response on %s", scope.get("path"), exc_info=True)

    async def _repair(self, send: Send, resp: _Response) -> None:
        msg = "the server handling this request stopped before it finished; retry the request"
        if not resp.started:
            await self._unavailable(send, resp, msg, "ingress_lost")
        elif resp.sse:
            body = b"data: " + _error_json(msg, "ingress_lost") + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": False})
            resp.ended = True
        else:  # a JSON body cut halfway: no valid way to finish it; close the response
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            resp.ended = True

    async def _unavailable(self, send: Send, resp: _Response, message: str, code: str) -> None:
        body = _error_json(message, code)
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.retry_after_s).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        resp.started = resp.ended = True


def proxy_middlewares() -> list[Any]:
    """The callback Ray's proxy calls (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): its middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyGuard)]  # type: ignore[arg-type]
