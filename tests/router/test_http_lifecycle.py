"""The HTTP request lifecycle against the real app (LocalServer over the real tiny engine): what a request holds
is released however the client leaves, and input OpenAI refuses is a 4xx here too."""

from __future__ import annotations

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
