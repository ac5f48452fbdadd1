"""The HTTP request lifecycle against the real app (LocalServer over the real tiny engine): what a request holds
is released however the client leaves, and input OpenAI refuses is a 4xx here too."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import aclosing

import httpx2
import pytest

from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.protocol import GenerateDelta

MODEL = "tiny-lifecycle"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    cfg = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=256, max_model_len=256, max_num_seqs=8)
    tenants = TenantRegistry(parse_tenants({"tenants": [{"id": "alpha", "api_key_sha256": [hash_api_key("key-alpha")]}],
                                            "admin_api_key_sha256": hash_api_key("key-admin")}))
    with LocalServer(lambda: local_ingress(cfg, tenants, model_name=MODEL, default_max_tokens=4),
                     grpc_port=None) as srv:
        yield srv


def _post(server: LocalServer, path: str, body: dict) -> httpx2.Response:
    return httpx2.post(server.http_url + path, json=body, headers={"Authorization": "Bearer key-alpha"}, timeout=60)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_stream_options_without_stream_true_is_a_400_naming_stream_options(server, path, body):
    """OpenAI (and vLLM) refuse ``stream_options`` on a non-streaming request; it was silently ignored."""
    for stream in ({}, {"stream": False}):
        r = _post(server, path, {"model": MODEL, **body, **stream, "stream_options": {"include_usage": True}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "stream_options" and "stream" in err["message"]
    r = _post(server, path, {"model": MODEL, **body, "stream_options": None})
    assert r.status_code == 200, r.text  # an explicit null is no option
    r = _post(server, path, {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_with_include_usage_every_chunk_but_the_last_carries_usage_null(server, path, body):
    """OpenAI's wire format under ``include_usage``: every chunk has a ``usage`` key, null but in the last (empty
    choices); without it, no chunk has one. The other chunks left the key out."""
    req = {"model": MODEL, **body, "stream": True, "max_tokens": 4}
    chunks = [json.loads(ln[6:]) for ln in _post(server, path, {**req, "stream_options": {"include_usage": True}})
              .text.split("\n") if ln.startswith("data: {")]
    assert len(chunks) >= 3 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    plain = [json.loads(ln[6:]) for ln in _post(server, path, req).text.split("\n") if ln.startswith("data: {")]
    assert plain and all("usage" not in c for c in plain)


def _errors(server: LocalServer, code: str) -> float:
    return server.ingress.metrics.request_errors.labels(model_name=MODEL, code=code)._value.get()


def test_client_that_disconnects_while_sending_its_body_is_no_server_error_and_frees_its_lease(server):
    """A body cut short by the client raised Starlette's ClientDisconnect: a logged 500 traceback and a 500 in the
    error metrics for every client that gave up mid-upload. It is now the 499 of any other client that left."""
    e500, e499 = _errors(server, "500"), _errors(server, "499")
    with socket.create_connection((server.host, server.http_port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-alpha\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while _errors(server, "499") == e499 and _errors(server, "500") == e500 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _errors(server, "500") == e500
    assert _errors(server, "499") == e499 + 1
    assert server.ingress.limiter.running("alpha") == 0


def _events(r: httpx2.Response) -> list:
    return [ln[6:] if ln[6:] == "[DONE]" else json.loads(ln[6:]) for ln in r.text.split("\n") if ln.startswith("data: ")]


def _aborting(real, after: int):  # type: ignore[no-untyped-def]
    """An engine `generate` that passes on ``after`` deltas of ``real``, then the engine's "abort" delta."""
    async def generate(req, *args):  # type: ignore[no-untyped-def]
        n = 0
        async with aclosing(real(req, *args)) as deltas:
            async for d in deltas:
                if n == after:
                    break
                n += 1
                yield d
        yield GenerateDelta(req.request_id, [], "", len(req.prompt_token_ids), 0, n, "abort")
    return generate


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_a_stream_the_engine_aborts_reports_an_error_never_finish_reason_stop(server, path, body):
    """The engine's "abort" delta (`engine.abort(request_id)`) was streamed as a chunk with finish_reason "stop",
    then the error event: the client read a finished answer and an error. Mid-stream it is now the error event
    alone; before any token a 503, as a non-streaming request gets."""
    engine = server.ingress.engine
    real = engine.generate
    req = {"model": MODEL, **body, "stream": True, "max_tokens": 40, "ignore_eos": True}
    try:
        engine.generate = _aborting(real, 1)
        r = _post(server, path, req)
        assert r.status_code == 200
        events = _events(r)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_aborted"
        reasons = [c["finish_reason"] for e in events[:-2] for c in e["choices"]]
        assert reasons and all(x is None for x in reasons), events
        engine.generate = _aborting(real, 0)
        r = _post(server, path, req)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_aborted", r.text
    finally:
        engine.generate = real
    assert server.ingress.limiter.running("alpha") == 0


def test_errors_sent_mid_stream_are_counted_in_request_errors(server):
    """An error after the first event goes out as an SSE error event (the status line is long sent); it was
    counted nowhere, so `chunkserve:request_errors` missed every stream that failed part-way."""
    engine = server.ingress.engine
    real = engine.generate
    before = _errors(server, "503")
    try:
        engine.generate = _aborting(real, 1)
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 40,
                                              "ignore_eos": True})
    finally:
        engine.generate = real
    assert r.status_code == 200 and _events(r)[-2]["error"]["code"] == "engine_aborted"
    assert _errors(server, "503") == before + 1


def test_a_stream_whose_client_stops_reading_is_aborted_after_the_write_timeout(caplog) -> None:
    """A client that keeps its connection open but reads nothing blocks the stream's next write for good; its
    request held its admission slot and KV chunks until it disconnected. The write now gives up after
    ``write_timeout_s`` and the body (hence the engine stream) is closed."""
    import anyio

    from chunkserve.router.http_app import AbortOnDisconnectStreamingResponse

    closed, sent = anyio.Event(), []

    async def body():  # type: ignore[no-untyped-def]
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
        finally:
            closed.set()

    async def send(message: dict) -> None:
        sent.append(message["type"])
        if len(sent) > 2:  # the socket's buffers are full: this write never completes
            await anyio.sleep_forever()

    async def receive() -> dict:  # the client never disconnects
        await anyio.sleep_forever()
        return {}

    async def main() -> float:
        resp = AbortOnDisconnectStreamingResponse(body(), media_type="text/event-stream", write_timeout_s=0.3)
        t = time.monotonic()
        with anyio.fail_after(10):
            await resp({"type": "http"}, receive, send)
        return time.monotonic() - t

    with caplog.at_level("WARNING", logger="chunkserve.router.http_app"):
        took = anyio.run(main)
    assert closed.is_set() and 0.3 <= took < 5, took
    assert any("read nothing" in r.getMessage() for r in caplog.records), caplog.records
    assert sent == ["http.response.start", "http.response.body", "http.response.body"]
