"""Cluster-wide metrics under real Ray Serve + a real Redis: the app from ``router.app.build_app`` with two
``random:tiny`` workers. The ingress's ``/metrics`` shows each worker's stats (read from the Redis
snapshots) and the cluster's KV usage; Ray's Prometheus endpoint shows the per-worker Ray Serve metrics
and the router's decisions by reason."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator

import httpx2
import pytest

from chunkserve.cluster.redis_server import RedisServer
from chunkserve.cluster.redis_server import (
    find_free_port as _free_port,  # outside Ray's and the kernel's ports
)

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow

MODEL = "tiny-metrics"
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(80)]  # 5 full chunks of 16: repeats hit the prefix cache


@pytest.fixture(scope="module")
def app(redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    """(ingress HTTP base URL, Ray metrics URL) of the running app."""
    from ray.serve.config import HTTPOptions

    from chunkserve.router.app import APP_NAME, AppConfig, build_app

    http_port, metrics_port = _free_port(), _free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(REPORT_INTERVAL_ENV, "1000")  # Ray's default (10 s) is too slow for a test
        # the ingress finds the workers' stats through $CHUNKSERVE_REDIS_URL, as under `chunkserve up`
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port,
                 runtime_env={"env_vars": {"CHUNKSERVE_REDIS_URL": redis_server.url}})
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=http_port))
        # one ingress replica: its own per-tenant counters are per replica (the worker and cluster
        # series below are not), and this test checks them against the whole request count
        cfg = AppConfig(model="random:tiny", model_name=MODEL, workers=2, redis_url=redis_server.url,
                        ingress_replicas=1,
                        engine={"chunk_size": 16, "num_kv_chunks": 64, "max_model_len": 256})
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        serve.shutdown()
        ray.shutdown()


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of metric ``name`` in a Prometheus text exposition."""
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$")
    return [(m.group(1) or "", float(m.group(2))) for line in text.splitlines() if (m := pat.match(line))]


def _label(labels: str, key: str) -> str | None:
    m = re.search(rf'{key}="([^"]*)"', labels)
    return m.group(1) if m else None


def _poll(fetch: Callable[[], str], ok: Callable[[str], bool], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        try:
            text = fetch()
        except httpx2.HTTPError:
            text = ""
        if text and ok(text):
            return text
        time.sleep(0.5)
    return text


def test_metrics_show_every_worker_and_the_cluster(app: tuple[str, str]) -> None:
    base, ray_metrics = app
    with httpx2.Client(base_url=base, timeout=60.0) as http:
        for _ in range(4):  # the same prompt: every request after the first hits the prefix cache
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                   "temperature": 0.0})
            assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 64

        def ingress_ready(text: str) -> bool:
            hits = _samples(text, "chunkserve:worker_prefix_cache_hits_total")
            return len(_samples(text, "chunkserve:worker_kv_cache_usage_perc")) == 2 and \
                sum(v for _, v in hits) >= 3 * 64

        text = _poll(lambda: http.get("/metrics").text, ingress_ready, timeout_s=20.0)

    # per worker, from the Redis snapshots: two distinct workers, each with its pool and usage
    usage = _samples(text, "chunkserve:worker_kv_cache_usage_perc")
    workers = {_label(lab, "worker_id") for lab, _ in usage}
    assert len(workers) == 2 and None not in workers, text
    assert all(0.0 <= v <= 1.0 for _, v in usage)
    assert {v for _, v in _samples(text, "chunkserve:worker_kv_chunks_total")} == {64.0}
    hits = sum(v for _, v in _samples(text, "chunkserve:worker_prefix_cache_hits_total"))
    queries = sum(v for _, v in _samples(text, "chunkserve:worker_prefix_cache_queries_total"))
    assert hits >= 3 * 64 and queries == 4 * len(PROMPT), text
    assert _samples(text, "chunkserve:cluster_stats_up") == [(f'{{model_name="{MODEL}"}}', 1.0)]
    assert _samples(text, "chunkserve:workers_reporting")[0][1] == 2.0
    # the cluster's KV usage: used / total over both workers (the prompt's chunks stay cached, not used)
    cluster = _samples(text, "chunkserve:kv_cache_usage_perc")
    assert len(cluster) == 1 and 0.0 <= cluster[0][1] <= 1.0
    # the ingress's own per-tenant counters agree that the prefix was hit
    assert sum(v for _, v in _samples(text, "chunkserve:prefix_cache_hits_total")) >= 3 * 64

    # Ray's Prometheus endpoint: the workers' Ray Serve metrics (tagged by worker) and router decisions
    def ray_ready(t: str) -> bool:
        return sum(v for _, v in _samples(t, "ray_chunkserve_worker_prefix_cache_hits_total")) >= 3 * 64 and \
            len(_samples(t, "ray_chunkserve_worker_kv_cache_usage_perc")) >= 2 and \
            bool(_samples(t, "ray_chunkserve_router_decisions_total"))

    rtext = _poll(lambda: httpx2.get(ray_metrics, timeout=10.0).text, ray_ready, timeout_s=30.0)
    assert ray_ready(rtext), rtext[-3000:]
    ray_workers = {_label(lab, "worker_id") for lab, _ in _samples(rtext, "ray_chunkserve_worker_kv_chunks_total")}
    assert ray_workers == workers
    for lab, _ in _samples(rtext, "ray_chunkserve_worker_kv_chunks_total"):
        assert _label(lab, "replica") == _label(lab, "worker_id")  # Serve's replica tag is the same id
    reasons = {_label(lab, "reason") for lab, _ in _samples(rtext, "ray_chunkserve_router_decisions_total")}
    assert reasons <= {"prefix_hit", "spill", "cold_hash", "redis_down", "no_chain"} and reasons
    assert sum(v for _, v in _samples(rtext, "ray_chunkserve_router_decisions_total")) >= 4


def _mapped_libraries(role: str) -> list[str]:
    """The shared objects mapped by each live Serve replica process of ``role`` (its process title)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if f"ServeReplica:chunkserve:{role}" in cmd:
            try:
                found.append(" ".join(m.path for m in p.memory_maps(grouped=True)))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    return found


def test_the_ingress_replica_never_loads_torch_while_the_workers_do(app: tuple[str, str]) -> None:
    base, _ = app
    with httpx2.Client(base_url=base, timeout=60.0) as http:
        body = {"model": MODEL, "prompt": PROMPT[:20], "max_tokens": 24, "temperature": 0.0}
        full = http.post("/v1/completions", json=body).json()
        r = http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(ln[len("data: "):]) for ln in r.text.split("\n\n")
              if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == full["choices"][0]["text"]
    assert events[-1]["usage"] == full["usage"]  # a coalesced stream keeps the usage
    ingress, workers = _mapped_libraries("Ingress"), _mapped_libraries("Worker")
    assert ingress and workers
    assert all("libtorch" not in maps for maps in ingress)
    assert all("libtorch" in maps for maps in workers)
