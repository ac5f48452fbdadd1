"""Robustness of the HTTP frontend on the real engine: generated inputs never produce a 500, and 200
concurrent requests from 8 tenants are all served while other clients send garbage."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import httpx2
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.workers.engine import EngineConfig

MODEL = "tiny-load"
CTX = 256
TENANTS = [f"t{i}" for i in range(8)]


def _tenants() -> TenantRegistry:
    scopes = ["private", "private", "private", "private", "shared:g1", "shared:g1", "shared:g2", "shared:g2"]
    return TenantRegistry(parse_tenants({"tenants": [
        {"id": t, "api_key_sha256": [hash_api_key(f"key-{t}")], "cache_scope": s, "max_concurrent_requests": 64}
        for t, s in zip(TENANTS, scopes, strict=True)]}))


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    cfg = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=1024, max_model_len=CTX,
                       max_num_seqs=64, max_num_batched_tokens=1024)
    with LocalServer(lambda: local_ingress(cfg, _tenants(), model_name=MODEL, default_max_tokens=3),
                     grpc_port=None) as srv:
        yield srv


def _check_response(r: httpx2.Response, stream: bool) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        return
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        body = r.json()
        assert body["choices"] and "prompt_tokens_details" in body["usage"]


_scalars = st.none() | st.booleans() | st.integers(-10, 10) | st.integers() | st.floats(allow_nan=False) | \
    st.text(max_size=20)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                   max_size=3), max_leaves=8)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot", ""]),
                                  "content": st.text(max_size=40) | _json})
_field_values = {
    "model": st.sampled_from([MODEL, "other", ""]) | _json,
    "messages": st.lists(_message, max_size=3) | _json,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 60000), max_size=8) | _json,
    "max_tokens": st.integers(-2, 4) | st.integers(CTX - 5, CTX + 5) | _json,
    "max_completion_tokens": st.integers(-1, 4) | _json,
    "temperature": st.floats(-1, 3, allow_nan=False) | _json,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | _json,
    "top_k": st.integers(-3, 50) | _json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | _json,
    "seed": st.integers() | _json,
    "n": st.integers(-1, 3) | _json,
    "user": st.text(max_size=10) | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _json,
    "unknown": _json,
}


@st.composite
def _bodies(draw: st.DrawFn) -> dict:
    """A valid body for either endpoint with a few fields replaced, removed or added."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}],
            "prompt": "hello"}
    for k in draw(st.lists(st.sampled_from(sorted(_field_values)), max_size=3, unique=True)):
        body[k] = draw(_field_values[k])
    for k in draw(st.lists(st.sampled_from(sorted(body)), max_size=2, unique=True)):
        body.pop(k)
    return body


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       body=_bodies() | _bodies() | _json,
       key=st.sampled_from(["key-t0", "key-t5", "key-t6", "wrong", None]),
       raw=st.none() | st.none() | st.binary(max_size=64))
def test_generated_inputs_never_produce_a_server_error(server, path, body, key, raw):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if isinstance(body, dict) and "messages" in body and "prompt" in body:
        body.pop("prompt" if path.endswith("chat/completions") else "messages")
    content = raw if raw is not None else json.dumps(body).encode()
    r = httpx2.post(server.http_url + path, content=content, headers=headers, timeout=60)
    stream = isinstance(body, dict) and body.get("stream") is True
    event(f"status {r.status_code}")
    _check_response(r, stream)


async def _garbage_client(url: str, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    codes = []
    async with httpx2.AsyncClient(timeout=60) as c:
        for _ in range(n):
            kind = rng.randrange(5)
            headers = {"Authorization": "Bearer key-t1"}
            if kind == 0:
                content = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            elif kind == 1:
                content = b'{"model": "tiny-load", "messages": [{"role": "user", "content": ' + b"[" * 5000
            elif kind == 2:
                content = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode()
                headers = {"Authorization": "Bearer stolen-key"}
            elif kind == 3:
                content = json.dumps({"model": MODEL, "prompt": "x" * 5000, "max_tokens": 2}).encode()
            else:
                content = json.dumps({"model": MODEL, "messages": [], "n": 7}).encode()
            r = await c.post(url + rng.choice(["/v1/chat/completions", "/v1/completions"]), content=content,
                             headers=headers)
            codes.append(r.status_code)
            assert "error" in r.json()
    return codes


async def _load(url: str) -> tuple[list[tuple[str, int, int, int]], list[list[int]]]:
    limits = httpx2.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx2.AsyncClient(timeout=120, limits=limits) as http:
        clients = {t: openai.AsyncOpenAI(base_url=url + "/v1", api_key=f"key-{t}", max_retries=0,
                                         http_client=http) for t in TENANTS}

        async def one(i: int) -> tuple[str, int, int, int]:
            t = TENANTS[i % 8]
            msgs = [{"role": "system", "content": f"System prompt of tenant {t}, shared by its users. " * 3},
                    {"role": "user", "content": f"request {i}"}]
            if i % 2:
                stream = await clients[t].chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=4, temperature=0.0, stream=True,
                    stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                u = chunks[-1].usage
            else:
                u = (await clients[t].chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                                              temperature=0.0)).usage
            return t, u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens

        results = asyncio.gather(*(one(i) for i in range(200)))
        garbage = asyncio.gather(*(_garbage_client(url, 25, s) for s in range(4)))
        return await results, await garbage


def test_200_concurrent_requests_from_8_tenants_are_all_served_while_others_send_garbage(server):
    t0 = time.monotonic()
    results, garbage = asyncio.run(_load(server.http_url))
    elapsed = time.monotonic() - t0
    assert len(results) == 200
    assert all(p > 0 and 1 <= c <= 4 for _t, p, c, _cached in results)
    per_tenant_cached = {t: sum(r[3] for r in results if r[0] == t) for t in TENANTS}
    assert all(v > 0 for v in per_tenant_cached.values())  # each tenant reused its own system prompt
    codes = [c for g in garbage for c in g]
    assert len(codes) == 100 and all(c in (400, 401, 413) for c in codes)
    st_ = server.call(server.ingress.engine_stats())
    deadline = time.monotonic() + 10
    while st_["num_sequences"] and time.monotonic() < deadline:
        time.sleep(0.05)
        st_ = server.call(server.ingress.engine_stats())
    assert st_["num_sequences"] == 0 and all(server.ingress.limiter.running(t) == 0 for t in TENANTS)
    print(f"200 requests + 100 garbage in {elapsed:.1f} s")
