"""A tenant over its limits, or a body of more messages than the context can hold, is refused before the
body is validated: validation holds the event loop every tenant shares (and the GIL) for ~3 us a message, so
a flood of 4 MiB bodies from one tenant stalled the others' requests ~100x while each of its own got a 429."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx2
import pytest

from chunkserve.router.grpc_service import to_openai_request
from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.openai_api import APIError
from chunkserve.router.ratelimit import RateLimited, RefusalMemo
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.v1 import generate_pb2 as pb
from chunkserve.workers.engine import EngineConfig

MODEL = "tiny-parse"
CTX = 256


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    def t(tid: str, **kw: object) -> dict:
        return {"id": tid, "api_key_sha256": [hash_api_key(f"key-{tid}")], **kw}

    tenants = TenantRegistry(parse_tenants({"tenants": [
        t("alpha"), t("slow", rate_limit={"requests_per_second": 0.05, "burst_requests": 1}),
        t("sloppy", rate_limit={"requests_per_second": 0.05, "burst_requests": 1}),
        t("narrow", max_concurrent_requests=1)]}))
    cfg = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=256, max_model_len=CTX, warmup=False)
    with LocalServer(lambda: local_ingress(cfg, tenants, model_name=MODEL, default_max_tokens=4),
                     grpc_port=None) as srv:
        yield srv


def _post(server: LocalServer, body: bytes | dict, key: str, path: str = "/v1/chat/completions") -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(server.http_url + path, content=content, timeout=60,
                       headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def _chat(text: str = "hi", **kw: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, **kw}


def test_a_tenant_refused_for_its_request_rate_is_refused_before_its_body_is_read(server: LocalServer) -> None:
    assert _post(server, _chat(), "key-slow").status_code == 200
    r = _post(server, _chat(), "key-slow")
    assert r.status_code == 429
    # a malformed body would be a 400 once parsed: the 429 says it never was
    r = _post(server, b"{not json", "key-slow")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and "requests/s" in r.text
    assert _post(server, b"{not json", "key-alpha").status_code == 400  # other tenants are parsed as before


def test_a_malformed_request_counts_against_the_tenants_request_rate(server: LocalServer) -> None:
    """Refused before admission, such requests counted against no limit: a tenant could send 4 MiB bodies
    without end, each parsed on the shared event loop."""
    assert _post(server, b"{not json", "key-sloppy").status_code == 400
    r = _post(server, _chat(), "key-sloppy")
    assert r.status_code == 429 and "requests/s" in r.text


def test_a_concurrency_refusal_ends_when_the_tenants_request_here_ends(server: LocalServer) -> None:
    body = _chat("count to a hundred", max_tokens=200, stream=True, temperature=1.0, seed=3)
    with httpx2.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer key-narrow"}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(lines)
        assert _post(server, _chat(), "key-narrow").status_code == 429
        assert _post(server, b"{not json", "key-narrow").status_code == 429  # remembered
    deadline = time.monotonic() + 10
    while server.ingress.limiter.running("narrow") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _post(server, b"{not json", "key-narrow").status_code == 400  # the slot is free: no longer held


def test_a_chat_of_more_messages_than_the_context_holds_is_refused_before_validation(server: LocalServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * (CTX + 1)}
    r = _post(server, body, "key-alpha")
    assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}] * CTX}]
    assert _post(server, {"model": MODEL, "messages": parts}, "key-alpha").status_code == 413
    ingress = SimpleNamespace(config=SimpleNamespace(max_model_len=CTX, model_name=MODEL))
    msg = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="a")] * (CTX + 1))
    with pytest.raises(APIError) as e:
        to_openai_request(ingress, msg, stream=False)  # gRPC: the same bound
    assert e.value.status == 413


def test_the_refusal_memo_holds_a_rate_refusal_for_its_wait_and_a_concurrency_one_until_a_release() -> None:
    now = [100.0]
    memo = RefusalMemo(max_hold_s=1.0, clock=lambda: now[0])
    memo.note("a", RateLimited("over 1 requests/s", 2.5, "requests"))
    memo.note("b", RateLimited("3 running", 1.0, "concurrency"))
    memo.note("c", RateLimited("over tokens/min", 9.0, "tokens"))  # depends on the size: not held
    for t in ("a", "b"):
        with pytest.raises(RateLimited):
            memo.check(t)
    memo.check("c")
    memo.released("a")  # a release does not refill a requests/s bucket
    memo.released("b")
    memo.check("b")
    now[0] += 2.0
    with pytest.raises(RateLimited) as e:
        memo.check("a")
    assert e.value.retry_after == pytest.approx(0.5)
    now[0] += 0.6
    memo.check("a")


def test_a_request_that_fails_before_running_ends_its_tenants_concurrency_refusal(server: LocalServer) -> None:
    """A request admitted, then failing before it ran (here: its body, which arrives after admission, is not
    JSON), freed its slot but not the refusal its tenant got meanwhile: the tenant's next requests were refused
    for up to a second with its slot free. Every lease's finish now ends a concurrency refusal."""
    with socket.create_connection((server.host, server.http_port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-narrow\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 9\r\n\r\n{not")
        deadline = time.monotonic() + 5  # admitted before its body is read: it holds narrow's one slot
        while server.ingress.limiter.running("narrow") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = _post(server, _chat(), "key-narrow")
        assert refused.status_code == 429 and "concurrent" in refused.text
        s.sendall(b" json")  # the rest of the body: not JSON, a 400
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
    assert _post(server, _chat(), "key-narrow").status_code == 200  # at once, not after the memo's hold
