"""The OpenAI HTTP API end to end: the official `openai` client against a real uvicorn server on a loopback
port, backed by the real in-process engine (a tiny random-weight Llama)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx2
import openai
import pytest

from chunkserve.cluster.hashing import hash_chain
from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.openai_api import ChatCompletionRequest, parse_request
from chunkserve.router.tenants import AuthError, TenantRegistry, hash_api_key, parse_tenants
from chunkserve.workers.engine import EngineConfig

MODEL = "tiny-test"
CTX = 512
CHUNK = 16
SYSTEM = ("You are the support assistant of a very large company. Answer politely, cite the policy "
          "number, never promise refunds, and keep every answer under one hundred words. ") * 3


def _tenants() -> TenantRegistry:
    def t(tid: str, **kw):
        return {"id": tid, "api_key_sha256": [hash_api_key(f"key-{tid}")], **kw}

    return TenantRegistry(parse_tenants({"tenants": [
        t("alpha"), t("beta"),
        t("gamma", cache_scope="shared:team"), t("delta", cache_scope="shared:team"),
        t("limited", rate_limit={"requests_per_second": 0.05, "burst_requests": 1}),
        t("narrow", max_concurrent_requests=1),
        t("tpm", rate_limit={"tokens_per_minute": 120}),
    ], "admin_api_key_sha256": hash_api_key("key-admin")}))


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    cfg = EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=512, max_model_len=CTX,
                       max_num_seqs=32)
    with LocalServer(lambda: local_ingress(cfg, _tenants(), model_name=MODEL, default_max_tokens=8,
                                   max_body_bytes=256 << 10),
                     grpc_port=None) as srv:
        yield srv


def client(server: LocalServer, tenant: str = "alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key=f"key-{tenant}", max_retries=0, timeout=60)


def chat(server: LocalServer, tenant: str, user: str, system: str = SYSTEM, **kw):
    return client(server, tenant).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=kw.pop("max_tokens", 4), temperature=0, **kw)


def test_ignore_eos_reaches_the_engines_sampling_params_only_when_set(server):
    for extra, want in (({"ignore_eos": True}, True), ({}, False), ({"ignore_eos": None}, False)):
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, **extra})
        req = parse_request(body.encode(), ChatCompletionRequest, 1 << 20)
        assert server.ingress._sampling(req, n_prompt=3).ignore_eos is want, extra


def test_models_lists_the_served_model(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(server).models.retrieve(MODEL).id == MODEL


def test_chat_completion_returns_text_and_usage(server):
    r = chat(server, "alpha", "What is the refund policy?", max_tokens=5)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 50
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_chat_stream_matches_non_streaming_and_reports_usage(server):
    chat(server, "alpha", "Stream me the answer.", max_tokens=6)  # warm-up: later calls hit the same cache
    full = chat(server, "alpha", "Stream me the answer.", max_tokens=6)
    stream = chat(server, "alpha", "Stream me the answer.", max_tokens=6, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # greedy: the same tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= CHUNK  # the prefix was cached by `full`


def test_raw_sse_ends_with_done_and_has_no_usage_unless_asked(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "stream": True}
    r = httpx2.post(server.http_url + "/v1/completions", json=body,
                    headers={"Authorization": "Bearer key-alpha"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [ln[len("data: "):] for ln in r.text.split("\n\n") if ln]
    assert events[-1] == "data: [DONE]"[len("data: "):]
    parsed = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in p for p in parsed) and parsed[-1]["choices"][0]["finish_reason"]


def test_completions_accept_text_and_token_prompts(server):
    c = client(server)
    r1 = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert r1.object == "text_completion" and r1.usage.completion_tokens >= 1
    r2 = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=2, temperature=0, seed=1)
    assert r2.usage.prompt_tokens == 5
    pieces = list(c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True, temperature=0,
                                       stream_options={"include_usage": True}))
    assert pieces[-1].choices == [] and 1 <= pieces[-1].usage.completion_tokens <= 3
    assert sum(1 for p in pieces if p.choices and p.choices[0].finish_reason) == 1


# Reuse is down to the token, so a tenant's earlier chats give it the chat template's head ("<|im_start|>
# system\n", a few tokens) in its own scope; "not cached" below means less than one chunk.
NOT_CACHED = CHUNK


def test_private_prefix_is_never_reported_cached_for_another_tenant(server):
    system = "Private playbook of tenant alpha: " + SYSTEM
    first = chat(server, "alpha", "question one", system=system)
    again = chat(server, "alpha", "question two", system=system)
    assert first.usage.prompt_tokens_details.cached_tokens < NOT_CACHED
    assert again.usage.prompt_tokens_details.cached_tokens >= 4 * CHUNK  # alpha hits its own prefix
    other = chat(server, "beta", "question one", system=system)  # the very same prompt as `first`
    assert other.usage.prompt_tokens_details.cached_tokens < NOT_CACHED
    gamma = chat(server, "gamma", "question one", system=system)  # a shared-scope tenant neither
    assert gamma.usage.prompt_tokens_details.cached_tokens < NOT_CACHED


def test_two_tenants_in_one_shared_group_share_a_prefix(server):
    system = "Public help-desk prompt of the team group: " + SYSTEM
    first = chat(server, "gamma", "how do I reset my password?", system=system)
    assert first.usage.prompt_tokens_details.cached_tokens < NOT_CACHED
    second = chat(server, "delta", "how do I reset my password?", system=system)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (second.usage.prompt_tokens // CHUNK - 1) * CHUNK
    assert chat(server, "alpha", "how do I reset my password?", system=system
                ).usage.prompt_tokens_details.cached_tokens < NOT_CACHED


def test_the_hash_chain_for_the_router_matches_the_chunks_the_engine_stores(server):
    engine = server.ingress.engine.engine  # LocalEngineClient -> AsyncEngine
    engine.drain_cache_events()
    prompt = "A prompt whose chunks the prefix index must find again. " * 6
    client(server, "gamma").completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    chain = hash_chain(server.ingress.tokenizer.encode(prompt), CHUNK, b"team")  # gamma: shared:team
    stored = {e.chunk_hash for e in engine.drain_cache_events() if e.kind == "stored"}
    assert len(chain) >= 4 and set(chain) <= stored
    assert not set(hash_chain(server.ingress.tokenizer.encode(prompt), CHUNK, b"gamma")) & stored


def _post(server: LocalServer, path: str, body: bytes | dict, key: str | None = "key-alpha"):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(server.http_url + path, content=content, headers=headers, timeout=60)


def _msgs(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


LONG = "word " * 700  # > 512 tokens


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", b"[]", 400, None),
    ("/v1/chat/completions", {"messages": _msgs()}, 400, "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": _msgs(), "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": _msgs(), "temperature": "x"}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": _msgs()}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": _msgs(), "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": _msgs(), "max_tokens": CTX + 1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": _msgs(), "max_completion_tokens": CTX - 5},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": _msgs(LONG)}, 413, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": _msgs(), "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 4}, 413, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**6]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 5, "stream": True}, 400, "n"),
    ("/v1/completions", {"model": "other", "prompt": "x", "stream": True}, 404, "model"),
])
def test_bad_inputs_get_the_right_status_and_openai_error_json(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_oversized_body_is_413_without_reading_it_whole(server):
    big = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"x" * (1 << 20) + b'"}'
    r = _post(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b'{"model": "%s", "prompt": "' % MODEL.encode()
        for _ in range(8):
            yield b"y" * (64 << 10)
        yield b'"}'

    r = httpx2.post(server.http_url + "/v1/completions", content=chunks(), timeout=60,
                    headers={"Authorization": "Bearer key-alpha", "Content-Type": "application/json"})
    assert r.status_code == 413  # chunked upload without Content-Length


def test_missing_or_unknown_api_key_is_401(server):
    body = {"model": MODEL, "messages": _msgs()}
    for key in (None, "key-nobody", "key-alph"):
        r = _post(server, "/v1/chat/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.http_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_two_authorization_headers_are_refused_whichever_comes_first(server):
    """HTTP read the first and gRPC the last: a request could carry two tenants' keys and be taken as either."""
    body = json.dumps({"model": MODEL, "messages": _msgs()}).encode()
    for pair in (("key-alpha", "key-nobody"), ("key-nobody", "key-alpha"), ("key-alpha", "key-beta")):
        headers = [("Content-Type", "application/json"), *(("Authorization", f"Bearer {k}") for k in pair)]
        r = httpx2.post(server.http_url + "/v1/chat/completions", content=body, headers=headers, timeout=60)
        assert r.status_code == 401 and "one Authorization" in r.json()["error"]["message"], pair
    meta = [("authorization", "Bearer key-alpha"), ("authorization", "Bearer key-beta")]
    with pytest.raises(AuthError, match="one Authorization"):
        server.ingress.tenants.authenticate_metadata(meta)


def test_unknown_route_and_wrong_method_are_json_errors(server):
    r = httpx2.get(server.http_url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx2.get(server.http_url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_tenant_over_its_request_rate_gets_429_with_retry_after(server):
    ok = chat(server, "limited", "first")
    assert ok.choices
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": _msgs()}, key="key-limited")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        chat(server, "limited", "third")
    assert chat(server, "alpha", "other tenants are unaffected").choices


def test_tenant_over_its_token_budget_gets_429(server):
    body = {"model": MODEL, "prompt": "tokens " * 50, "max_tokens": 60}  # ~110 of the 120 tokens/min
    assert _post(server, "/v1/completions", body, key="key-tpm").status_code == 200
    r = _post(server, "/v1/completions", body, key="key-tpm")
    assert r.status_code == 429 and "tokens/min" in r.json()["error"]["message"]


def test_concurrency_limit_rejects_a_second_running_request(server):
    body = {"model": MODEL, "prompt": "count to a hundred", "max_tokens": 400, "stream": True,
            "temperature": 1.0, "seed": 3}
    headers = {"Authorization": "Bearer key-narrow"}
    with httpx2.stream("POST", server.http_url + "/v1/completions", json=body, headers=headers,
                       timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # keep a reference: a dropped iterator closes the connection
        next(lines)
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}, key="key-narrow")
        assert r.status_code == 429 and "concurrent" in r.json()["error"]["message"]


def _engine_stats(server: LocalServer) -> dict:
    return server.call(server.ingress.engine_stats())


def _wait_idle(server: LocalServer, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _engine_stats(server)
        if (st["num_sequences"] == 0 and st["kv_chunks_used"] == 0) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_client_disconnect_mid_stream_aborts_the_request_and_frees_its_kv_chunks(server):
    assert _wait_idle(server)["kv_chunks_used"] == 0
    body = {"model": MODEL, "prompt": "Tell me a very long story about dragons. " * 4, "max_tokens": 400,
            "stream": True, "temperature": 1.0, "seed": 7}
    before = server.ingress.metrics.request_success.labels(model_name=MODEL, tenant="beta",
                                                           finished_reason="abort")._value.get()
    with httpx2.stream("POST", server.http_url + "/v1/completions", json=body,
                       headers={"Authorization": "Bearer key-beta"}, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        busy = _engine_stats(server)
        deadline = time.monotonic() + 5
        while busy["kv_chunks_used"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
            busy = _engine_stats(server)
        assert busy["kv_chunks_used"] > 0 and busy["num_sequences"] == 1
    # the client closed the connection after three events: the request is aborted and its chunks freed
    st = _wait_idle(server)
    assert st["num_sequences"] == 0 and st["kv_chunks_used"] == 0
    after = server.ingress.metrics.request_success.labels(model_name=MODEL, tenant="beta",
                                                          finished_reason="abort")._value.get()
    assert after == before + 1
    assert server.ingress.limiter.running("beta") == 0


def test_client_that_leaves_a_stream_before_its_first_token_aborts_the_request(server):
    """A queued streaming request whose client gives up is aborted at once, not run to its first token."""
    ended = threading.Event()
    engine = server.ingress.engine
    real = engine.generate

    async def queued(req, *args):  # type: ignore[no-untyped-def]  (the request waits 30 s for its first token)
        try:
            await asyncio.sleep(30)
            async for d in real(req, *args):
                yield d
        finally:
            ended.set()

    engine.generate = queued
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(server.http_url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-beta"},
                        timeout=httpx2.Timeout(60, read=0.3))
        assert ended.wait(5)  # cancelled with the connection: the engine request and its lease end with it
        deadline = time.monotonic() + 5
        while server.ingress.limiter.running("beta") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.ingress.limiter.running("beta") == 0
    finally:
        engine.generate = real


def test_client_that_gives_up_on_a_non_streaming_request_aborts_it(server):
    assert _wait_idle(server)["kv_chunks_used"] == 0
    aborted = server.ingress.metrics.request_success.labels(model_name=MODEL, tenant="alpha",
                                                            finished_reason="abort")
    before = aborted._value.get()
    body = {"model": MODEL, "prompt": "An endless list of numbers: 1, 2, 3,", "max_tokens": 480,
            "temperature": 1.0, "seed": 11}
    # a non-streaming answer sends nothing until it ends: 480 decode steps take well over 0.3 s (a bf16 step of
    # this tiny model is ~1.5 ms on a Zen 4 core; it once took 1 s, the earlier read timeout, which a faster CPU beat)
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(server.http_url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-alpha"},
                    timeout=httpx2.Timeout(60, read=0.3))
    st = _wait_idle(server, timeout=5)
    assert st["num_sequences"] == 0 and st["kv_chunks_used"] == 0
    assert aborted._value.get() == before + 1


def test_metrics_endpoint_needs_the_admin_key_in_tenant_mode_and_exposes_cache_and_latency_metrics(server):
    chat(server, "delta", "metrics please")
    chat(server, "delta", "metrics please")
    for auth in ({}, {"Authorization": "Bearer key-delta"}):  # no key, or a tenant's key: refused
        r = httpx2.get(server.http_url + "/metrics", headers=auth, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    text = httpx2.get(server.http_url + "/metrics", headers={"Authorization": "Bearer key-admin"}, timeout=10).text
    for name in ("chunkserve:prefix_cache_queries_total", "chunkserve:prefix_cache_hits_total",
                 "chunkserve:num_requests_running", "chunkserve:num_requests_waiting",
                 "chunkserve:time_to_first_token_seconds_count", "chunkserve:time_per_output_token_seconds",
                 "chunkserve:e2e_request_latency_seconds_count", "chunkserve:kv_cache_usage_perc"):
        assert name in text, name
    hits = [ln for ln in text.splitlines()
            if ln.startswith('chunkserve:prefix_cache_hits_total{') and 'tenant="delta"' in ln]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= CHUNK
    assert httpx2.get(server.http_url + "/health", timeout=10).json() == {"status": "ok"}


def test_health_is_liveness_and_ready_reports_an_in_process_engine_ready_at_once(server):
    assert httpx2.get(server.http_url + "/health", timeout=10).json() == {"status": "ok"}
    ready = httpx2.get(server.http_url + "/ready", timeout=10)  # no API key needed: a probe's route
    assert ready.status_code == 200 and ready.json() == {"ready": True, "workers": 1}
