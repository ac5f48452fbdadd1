"""The HTTP request lifecycle against the real app (LocalServer over the real tiny engine): what a request holds
is released however the client leaves, and input OpenAI refuses is a 4xx here too."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx2
import pytest

from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.workers.engine import EngineConfig

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
