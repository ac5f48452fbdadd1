"""The ingress under Ray Serve: one ``@serve.ingress()`` deployment answers both the HTTP proxy (OpenAI API)
and the gRPC proxy (``grpc_options``), and calls a worker deployment through a streaming DeploymentHandle
with ``chunk_hashes=`` (the real in-process engine inside the worker replica)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx2
import openai
import pytest

from chunkserve.client import ChunkServeError, GrpcClient
from chunkserve.cluster.redis_server import (
    find_free_port as _free_port,  # outside Ray's and the kernel's ports
)
from chunkserve.router.engine_client import HandleEngineClient
from chunkserve.router.ingress import Ingress, IngressConfig
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.workers.engine import EngineConfig

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MODEL = "tiny-ray"
ECFG = EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=12, max_model_len=256)  # pool: 192 tokens
TENANTS = {"tenants": [{"id": "acme", "api_key_sha256": [hash_api_key("sk-acme")]},
                       {"id": "slow", "api_key_sha256": [hash_api_key("sk-slow")],
                        "rate_limit": {"requests_per_second": 0.05, "burst_requests": 1}}]}


@serve.deployment
class Worker:
    """A minimal worker replica over the real AsyncEngine (the production one lives elsewhere)."""

    def __init__(self) -> None:
        from chunkserve.workers.async_engine import AsyncEngine

        self.engine = AsyncEngine(ECFG)
        self.last_chain: list[int] = []

    async def generate(self, request, chunk_hashes=None):
        self.last_chain = list(chunk_hashes or [])
        async for delta in self.engine.generate(request):
            yield delta

    def stats(self) -> dict:
        return {**self.engine.stats(), "last_chain_len": len(self.last_chain)}


@serve.deployment
@serve.ingress()
class Front(Ingress):
    """The whole Ray wiring of the frontend: build the parts, hand them to Ingress."""

    def __init__(self, worker) -> None:
        from chunkserve.workers.weights import load_model

        tokenizer = load_model(ECFG.model).tokenizer
        super().__init__(HandleEngineClient(worker), tokenizer, TenantRegistry(parse_tenants(TENANTS)),
                         IngressConfig(MODEL, max_model_len=256, chunk_size=16))


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, str]]:
    from ray.serve.config import HTTPOptions, gRPCOptions

    http_port, grpc_port = _free_port(), _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=http_port),
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[
                        "chunkserve.v1.generate_pb2_grpc.add_ChunkServeServicer_to_server"]))
        serve.run(Front.bind(Worker.bind()), name="chunkserve", route_prefix="/")
        yield f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _worker_stats() -> dict:
    return serve.get_deployment_handle("Worker", app_name="chunkserve").stats.remote().result()


@pytest.mark.slow
def test_http_and_grpc_reach_one_ingress_deployment_under_ray_serve(cluster):
    http_url, grpc_target = cluster
    c = openai.OpenAI(base_url=http_url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)
    msgs = [{"role": "system", "content": "You answer in one word. " * 10}, {"role": "user", "content": "Hi"}]
    c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)  # warm-up
    first = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == first.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    assert _worker_stats()["last_chain_len"] == first.usage.prompt_tokens // 16  # chunk_hashes= reached it
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=4)

    with GrpcClient(grpc_target, api_key="sk-acme") as g:
        r = g.generate(messages=msgs, max_tokens=4, temperature=0.0)
        assert r.text == text and r.usage.cached_tokens >= 16
        pieces = list(g.generate_stream(messages=msgs, max_tokens=4, temperature=0.0))
        assert "".join(p.text for p in pieces) == text and pieces[-1].usage.completion_tokens >= 1
        for stream in (False, True):
            with pytest.raises(ChunkServeError) as ei:
                out = g.generate_stream(prompt="x", model="nope") if stream else g.generate(prompt="x",
                                                                                             model="nope")
                list(out) if stream else None
            assert ei.value.status == "NOT_FOUND" and "nope" in ei.value.message
    with GrpcClient(grpc_target, api_key="sk-slow") as slow:
        slow.generate(prompt="x", max_tokens=1)
        with pytest.raises(ChunkServeError) as ei:
            slow.generate(prompt="x", max_tokens=1)
        assert ei.value.status == "RESOURCE_EXHAUSTED" and ei.value.retry_after >= 1
        with pytest.raises(ChunkServeError) as ei:
            list(slow.generate_stream(prompt="x", max_tokens=1))
        assert ei.value.status == "RESOURCE_EXHAUSTED" and "retry after" in ei.value.message
    with GrpcClient(grpc_target, api_key="bad") as bad, pytest.raises(ChunkServeError) as ei:
        list(bad.generate_stream(prompt="x"))
    assert ei.value.status == "UNAUTHENTICATED"
    assert grpc.StatusCode.UNAUTHENTICATED.name == ei.value.status


@pytest.mark.slow
def test_a_prompt_the_worker_pool_cannot_hold_is_413_through_ray(cluster):
    http_url, grpc_target = cluster
    c = openai.OpenAI(base_url=http_url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)
    prompt = list(range(100, 320))  # 220 tokens: within the 256-token context, beyond the 192-token pool
    with pytest.raises(openai.APIStatusError) as ei:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert ei.value.status_code == 413 and "KV pool" in ei.value.message and "Traceback" not in ei.value.message
    with GrpcClient(grpc_target, api_key="sk-acme") as g, pytest.raises(ChunkServeError) as ge:
        list(g.generate_stream(prompt_token_ids=prompt, max_tokens=4))
    assert ge.value.status == "INVALID_ARGUMENT" and "KV pool" in ge.value.message


@pytest.mark.slow
def test_http_disconnect_under_ray_serve_aborts_the_worker_request(cluster):
    http_url, _ = cluster
    max_tokens = 150
    body = {"model": MODEL, "prompt": "Write a very long poem. " * 3, "max_tokens": max_tokens, "stream": True,
            "temperature": 1.0, "seed": 2}
    before = _worker_stats()["tokens_computed"]
    with httpx2.stream("POST", http_url + "/v1/completions", json=body,
                       headers={"Authorization": "Bearer sk-acme"}, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(2):
            next(lines)
    deadline = time.monotonic() + 10
    st = _worker_stats()
    while (st["num_sequences"] or st["kv_chunks_used"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        st = _worker_stats()
    assert st["num_sequences"] == 0 and st["kv_chunks_used"] == 0
    time.sleep(1.0)  # an aborted request computes nothing more
    computed = _worker_stats()["tokens_computed"] - before
    print("tokens computed before the abort:", computed)
    # prompt (~18) + the tokens decoded before the abort; run to the end it would be ~18 + 150 (the cancel
    # travels proxy -> ingress -> worker while the worker decodes at full speed: no tighter bound on a loaded box)
    assert computed < max_tokens
