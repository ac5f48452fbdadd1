"""cache_control through the HTTP and gRPC APIs (issue 16): a real uvicorn + grpc.aio server over the real
in-process engine (a tiny random-weight Llama), a small KV pool so that another tenant can flood it."""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import httpx2
import pytest

from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.v1 import generate_pb2_grpc as pb_grpc
from chunkserve.workers.engine import EngineConfig

MODEL = "tiny-test"
CHUNK = 16
POOL = 96  # chunks: 1,536 tokens
SYSTEM = ("You are the support assistant of a very large company. Answer politely, cite the policy "
          "number, never promise refunds, and keep every answer under one hundred words. ") * 4


def _tenants() -> TenantRegistry:
    def t(tid: str, **kw):
        return {"id": tid, "api_key_sha256": [hash_api_key(f"key-{tid}")], **kw}

    return TenantRegistry(parse_tenants({"tenants": [
        t("alpha"), t("beta"), t("short", cache_pins={"allowed_ttls": ["5m"]}),
        t("tight", cache_pins={"max_pinned_tokens": 32}),
        t("lenient", cache_pins={"max_pinned_tokens": 32, "on_pool_full": "unpinned"}),
    ], "admin_api_key_sha256": hash_api_key("key-admin")}))


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    cfg = EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=POOL, max_model_len=512,
                       max_num_seqs=8)
    with LocalServer(lambda: local_ingress(cfg, _tenants(), model_name=MODEL, default_max_tokens=4)) as srv:
        yield srv


def post(server: LocalServer, tenant: str, messages: list[dict], **kw) -> httpx2.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **kw}
    return httpx2.post(server.http_url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer key-{tenant}"})


def marked(user: str, ttl: str = "5m", system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system, "cache_control": {"type": "ephemeral", "ttl": ttl}},
            {"role": "user", "content": user}]


def flood(server: LocalServer, tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    sent = 0
    while sent < tokens:
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(50))
        r = post(server, "beta", [{"role": "user", "content": words}])
        assert r.status_code == 200, r.text
        sent += r.json()["usage"]["prompt_tokens"]


def details(r: httpx2.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize("pin", [True, False])
def test_a_marked_system_prompt_survives_a_flood_of_5x_the_pool(server: LocalServer, pin: bool) -> None:
    system = f"[{'pinned' if pin else 'plain'}] " + SYSTEM
    msgs = marked("first question", system=system) if pin else [{"role": "system", "content": system},
                                                                 {"role": "user", "content": "first question"}]
    first = details(post(server, "alpha", msgs))
    assert first["cached_tokens"] < CHUNK  # not cached yet (the chat template's head may match, to the token)
    assert (first["cache_creation_tokens"] >= 6 * CHUNK) == pin
    flood(server, 5 * POOL * CHUNK, seed=int(pin))
    again = details(post(server, "alpha", [dict(msgs[0]), {"role": "user", "content": "second question"}]))
    if pin:
        assert again["cached_tokens"] >= first["cache_creation_tokens"] and again["cache_creation_tokens"] == 0
    else:
        assert again["cached_tokens"] < 2 * CHUNK


@pytest.mark.parametrize("bad, field", [
    ({"type": "persistent"}, "messages.0.cache_control.type"),
    ({"type": "ephemeral", "ttl": "10m"}, "messages.0.cache_control.ttl"),
    ({"type": "ephemeral", "ttl": 300}, "messages.0.cache_control.ttl"),
    ({"type": "ephemeral", "scope": "global"}, "messages.0.cache_control.scope"),
    ("yes", "messages.0.cache_control"),
])
def test_a_malformed_cache_control_is_a_400_naming_the_field(server: LocalServer, bad, field: str) -> None:
    r = post(server, "alpha", [{"role": "system", "content": "x", "cache_control": bad},
                               {"role": "user", "content": "hi"}])
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]


def test_a_ttl_the_tenant_may_not_use_is_a_400(server: LocalServer) -> None:
    r = post(server, "short", marked("q", ttl="1h"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.cache_control.ttl"
    assert post(server, "short", marked("q", ttl="5m")).status_code == 200


def test_the_pin_quota_refuses_with_429_or_serves_unpinned_as_the_tenant_says(server: LocalServer) -> None:
    r = post(server, "tight", marked("q"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "cache_pin_refused"
    assert "quota" in r.json()["error"]["message"]
    ok = details(post(server, "lenient", marked("q")))
    assert ok["cache_creation_tokens"] == 0


def test_grpc_passes_cache_control_through_and_reports_cache_creation(server: LocalServer) -> None:
    system = "[grpc] " + SYSTEM
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.ChunkServeStub(ch)
        md = (("authorization", "Bearer key-alpha"),)

        def call(user: str, cc: pb.CacheControl | None) -> pb.GenerateResponse:
            sys_msg = pb.ChatMessage(role="system", content=system)
            if cc is not None:
                sys_msg.cache_control.CopyFrom(cc)
            req = pb.GenerateRequest(messages=[sys_msg, pb.ChatMessage(role="user", content=user)],
                                     sampling=pb.SamplingParams(max_tokens=2, temperature=0))
            return stub.Generate(req, metadata=md, timeout=120)

        first = call("a", pb.CacheControl(type="ephemeral", ttl="1h"))
        assert first.usage.cache_creation_tokens >= 6 * CHUNK
        again = call("b", pb.CacheControl(type="ephemeral"))  # ttl defaults to 5m
        assert again.usage.cached_tokens >= first.usage.cache_creation_tokens
        with pytest.raises(grpc.RpcError) as e:
            call("c", pb.CacheControl(type="ephemeral", ttl="2d"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_control.ttl" in e.value.details()


def test_metrics_show_pinned_tokens_served_tokens_and_share_per_tenant(server: LocalServer) -> None:
    details(post(server, "alpha", marked("metrics question", system="[metrics] " + SYSTEM)))
    text = httpx2.get(server.http_url + "/metrics", headers={"Authorization": "Bearer key-admin"}, timeout=30).text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[-1]) for ln in text.splitlines()
             if ln.startswith("chunkserve:tenant_") and 'tenant="alpha"' in ln}
    pinned = [v for k, v in lines.items() if k.startswith("chunkserve:tenant_pinned_tokens{")]
    assert pinned and pinned[0] >= 6 * CHUNK
    assert any(k.startswith("chunkserve:tenant_served_tokens_total{") and 'kind="prefill"' in k and v > 0
               for k, v in lines.items())
    assert any(k.startswith("chunkserve:tenant_share{") and v > 0 for k, v in lines.items())
    assert any(k.startswith("chunkserve:tenant_queue_time_seconds_total{") for k in lines)
