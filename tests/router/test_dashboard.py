"""/dashboard and its JSON endpoint on a real server (uvicorn, in-process tiny engine): access rules, the
forest with shared and private scopes, per-tenant tokens, and no prompt text anywhere."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.workers.engine import EngineConfig

MODEL = "tiny-dash"
CHUNK = 16
SHARED = "Shared group system prompt about the billing policy of the company, version seven. " * 3
PRIVATE = "Private system prompt of initech that nobody else may see, with its secret plan. " * 3


def _tenants() -> TenantRegistry:
    def t(tid: str, **kw: Any) -> dict[str, Any]:
        return {"id": tid, "api_key_sha256": [hash_api_key(f"key-{tid}")], **kw}

    return TenantRegistry(parse_tenants({"tenants": [
        t("acme", cache_scope="shared:grp"), t("globex", cache_scope="shared:grp"), t("initech")],
        "admin_api_key_sha256": hash_api_key("key-admin")}))


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _complete(base: str, key: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Authorization": f"Bearer {key}",
                                                                   "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    cfg = EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=256, max_model_len=512)
    with LocalServer(lambda: local_ingress(cfg, _tenants(), model_name=MODEL), grpc_port=None) as srv:
        yield srv


def test_page_and_assets_are_served_from_the_package(server: LocalServer) -> None:
    code, html = _get(server.http_url + "/dashboard")
    assert code == 200 and b"/dashboard/static/dashboard.js" in html and b"http" not in html.split(b"<body>")[1]
    assert _get(server.http_url + "/dashboard/static/dashboard.js")[0] == 200
    assert _get(server.http_url + "/dashboard/static/dashboard.css")[0] == 200
    assert _get(server.http_url + "/dashboard/static/..%2Fdashboard.py")[0] == 404


def test_state_needs_the_admin_key(server: LocalServer) -> None:
    url = server.http_url + "/dashboard/api/state"
    code, body = _get(url)
    assert code == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    code, body = _get(url, "key-acme")
    assert code == 403 and "admin" in json.loads(body)["error"]["message"]
    assert _get(url, "nonsense")[0] == 401
    assert _get(url, "key-admin")[0] == 200


def test_state_shows_shared_and_private_scopes_and_tenant_tokens_without_text(server: LocalServer) -> None:
    base = server.http_url
    for key, user in (("key-acme", "a1"), ("key-globex", "g1"), ("key-acme", "a2"), ("key-globex", "g2")):
        _complete(base, key, SHARED + user)
    _complete(base, "key-initech", PRIVATE + "i1")
    t0 = time.perf_counter()
    code, raw = _get(base + "/dashboard/api/state", "key-admin")
    elapsed = time.perf_counter() - t0
    assert code == 200, raw
    state = json.loads(raw)
    (worker,) = state["workers"]
    scopes = {s["scope"]: s for s in worker["forest"]["scopes"]}
    assert set(scopes) == {"shared:grp", "private:initech"}
    (shared,) = scopes["shared:grp"]["runs"]
    assert shared["tenants"] == ["acme", "globex"] and shared["hits"] >= 3
    assert scopes["private:initech"]["runs"][0]["tenants"] == ["initech"]
    tenants = {t["tenant"]: t for t in state["tenants"]}
    assert tenants["globex"]["cached"] > 0 and tenants["initech"]["cached"] == 0
    assert tenants["initech"]["prefilled"] > 0 and tenants["acme"]["decoded"] == 4
    assert state["hit_rate"]["points"] and state["hit_rate"]["cumulative"] > 0
    assert "billing" not in raw.decode() and "secret" not in raw.decode()
    assert elapsed < 1.0


def test_open_mode_serves_local_clients() -> None:
    cfg = EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=64, max_model_len=256)
    with LocalServer(lambda: local_ingress(cfg, TenantRegistry(None), model_name=MODEL), grpc_port=None) as srv:
        code, raw = _get(srv.http_url + "/dashboard/api/state")
        assert code == 200 and json.loads(raw)["workers"][0]["worker_id"] == "local"
