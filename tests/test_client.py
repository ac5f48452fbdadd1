"""chunkserve.client against a real local server (HTTP + gRPC) backed by the real in-process engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from chunkserve.client import AsyncGrpcClient, ChunkServeError, GrpcClient, HTTPClient, build_request
from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.workers.engine import EngineConfig

MODEL = "tiny-client"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    reg = TenantRegistry(parse_tenants({"admin_api_key_sha256": [hash_api_key("sk-admin")], "tenants": [
        {"id": "acme", "api_key_sha256": [hash_api_key("sk-acme")]},
        {"id": "slow", "api_key_sha256": [hash_api_key("sk-slow")],
         "rate_limit": {"requests_per_second": 0.05, "burst_requests": 1}},
    ]}))
    cfg = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=256, max_model_len=256)
    with LocalServer(lambda: local_ingress(cfg, reg, model_name=MODEL, default_max_tokens=4)) as srv:
        yield srv


def test_http_client_chat_and_completion_with_and_without_streaming(server):
    c = HTTPClient(server.http_url, api_key="sk-acme")
    assert c.health() and c.models() == [MODEL] and c.model == MODEL
    msgs = [{"role": "user", "content": "Say something."}]
    c.chat(msgs, max_tokens=5, temperature=0)  # warm-up: the compared calls see the same cached prefix
    full = c.chat(msgs, max_tokens=5, temperature=0)
    chunks = list(c.chat(msgs, stream=True, max_tokens=5, temperature=0))
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    c.complete("Once upon", max_tokens=3, temperature=0)
    comp = c.complete("Once upon", max_tokens=3, temperature=0)
    streamed = list(c.complete("Once upon", stream=True, max_tokens=3, temperature=0))
    assert "".join(p["choices"][0]["text"] for p in streamed if p["choices"]) == comp["choices"][0]["text"]
    # tenant mode: /metrics takes the admin key, never a tenant's
    assert "chunkserve:e2e_request_latency_seconds" in HTTPClient(server.http_url, api_key="sk-admin").metrics()
    with pytest.raises(ChunkServeError) as ei:
        c.metrics()
    assert ei.value.status == 403


def test_http_client_raises_errors_with_status_and_retry_after(server):
    with pytest.raises(ChunkServeError) as ei:
        HTTPClient(server.http_url, api_key="sk-wrong", model=MODEL).chat([{"role": "user", "content": "x"}])
    assert ei.value.status == 401 and ei.value.type == "authentication_error"
    with pytest.raises(ChunkServeError) as ei:
        HTTPClient(server.http_url, api_key="sk-acme", model=MODEL).chat([], max_tokens=2)
    assert ei.value.status == 400 and "messages" in ei.value.message
    slow = HTTPClient(server.http_url, api_key="sk-slow", model=MODEL)
    slow.complete("hi", max_tokens=1)
    with pytest.raises(ChunkServeError) as ei:
        slow.complete("hi", max_tokens=1)
    assert ei.value.status == 429 and ei.value.retry_after >= 1
    assert not HTTPClient("http://127.0.0.1:9", timeout=2).health()


def test_grpc_client_unary_and_streaming(server):
    with GrpcClient(server.grpc_target, api_key="sk-acme") as g:
        msgs = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Hi"}]
        g.generate(messages=msgs, max_tokens=4, temperature=0.0)  # warm-up
        r = g.generate(messages=msgs, max_tokens=4, temperature=0.0)
        pieces = list(g.generate_stream(messages=msgs, max_tokens=4, temperature=0.0))
        assert "".join(p.text for p in pieces) == r.text and pieces[-1].finish_reason == r.finish_reason
        assert pieces[-1].usage.cached_tokens >= 16 and r.usage.prompt_tokens == pieces[-1].usage.prompt_tokens
        ids = g.generate(prompt_token_ids=[3, 4, 5], max_tokens=2, seed=1, stop=["\n"])
        assert ids.usage.prompt_tokens == 3
        with pytest.raises(ChunkServeError) as ei:
            g.generate(prompt="x", max_tokens=0)
        assert ei.value.status == "INVALID_ARGUMENT"
    with GrpcClient(server.grpc_target, api_key="sk-nope") as bad, pytest.raises(ChunkServeError) as ei:
        list(bad.generate_stream(prompt="x"))
    assert ei.value.status == "UNAUTHENTICATED"


def test_async_grpc_client(server):
    async def run() -> tuple[str, str]:
        c = AsyncGrpcClient(server.grpc_target, api_key="sk-acme")
        try:
            await c.generate(prompt="The sky is", max_tokens=3, temperature=0.0)  # warm-up
            r = await c.generate(prompt="The sky is", max_tokens=3, temperature=0.0)
            s = "".join([p.text async for p in c.generate_stream(prompt="The sky is", max_tokens=3,
                                                                   temperature=0.0)])
            return r.text, s
        finally:
            await c.close()

    unary, streamed = asyncio.run(run())
    assert unary == streamed


def test_build_request_sets_only_given_sampling_fields():
    r = build_request(prompt="p", max_tokens=3, stop="x")
    assert r.HasField("prompt") and r.sampling.max_tokens == 3 and list(r.sampling.stop) == ["x"]
    assert not r.sampling.HasField("temperature") and not r.sampling.HasField("seed")
