"""Per-worker metrics from engine stats, and the worker's stats snapshot in a real Redis."""

from __future__ import annotations

import asyncio
import json

import redis

from chunkserve.cluster.redis_server import RedisServer
from chunkserve.cluster.stats import stats_key
from chunkserve.workers.deployment import WorkerServer
from chunkserve.workers.protocol import GenerateRequest
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.worker_metrics import WorkerMetrics


def test_counters_add_the_growth_of_cumulative_stats() -> None:
    m = WorkerMetrics("w1", enable_ray=False)
    m.update({"prompt_tokens_total": 100, "prefix_cached_tokens": 0, "num_preemptions": 0,
              "kv_cache_usage_perc": 0.5, "kv_chunks_total": 64})
    m.update({"prompt_tokens_total": 180, "prefix_cached_tokens": 64, "num_preemptions": 1,
              "kv_cache_usage_perc": 0.25, "kv_chunks_total": 64})
    assert m.totals == {"prefix_cache_queries": 180.0, "prefix_cache_hits": 64.0, "num_preemptions": 1.0,
                        "engine_step_seconds": 0.0, "engine_step_cpu_seconds": 0.0,
                        "engine_step_runqueue_seconds": 0.0}
    assert m.gauges["kv_cache_usage_perc"] == 0.25 and m.gauges["kv_chunks_total"] == 64.0
    m.update({"prompt_tokens_total": 30, "prefix_cached_tokens": 64})  # a new engine restarts its counters
    assert m.totals["prefix_cache_queries"] == 210.0 and m.totals["prefix_cache_hits"] == 64.0
    assert not m.ray_enabled


def test_worker_reports_metrics_and_writes_its_snapshot() -> None:
    prompt = tuple((5 * i + 1) % 200 + 1 for i in range(48))  # 3 full chunks of 16

    async def run(url: str) -> tuple[WorkerServer, dict]:
        server = WorkerServer({"model": "random:tiny", "chunk_size": 16, "num_kv_chunks": 32,
                               "max_model_len": 128}, "w-test", redis_url=url, enable_ray_metrics=False)
        try:
            for i in range(2):
                req = GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=2, temperature=0.0))
                async for _ in server.generate(req):
                    pass
            await asyncio.sleep(0.3)  # the engine thread refreshes its stats snapshot
            st = await server.report_stats()
            return server, st
        finally:
            server.shutdown()

    with RedisServer() as srv:
        client = redis.Redis.from_url(srv.url)
        key = stats_key("chunkserve", "w-test")
        server, st = asyncio.run(run(srv.url))
        assert client.get(key) is None  # a graceful shutdown drops the snapshot at once
    assert st["prompt_tokens_total"] == 96 and st["prefix_cached_tokens"] >= 32
    assert server.metrics.totals["prefix_cache_queries"] == 96
    assert server.metrics.totals["prefix_cache_hits"] == st["prefix_cached_tokens"]
    assert server.metrics.gauges["kv_chunks_total"] == 32
    # the engine thread's clock: 4 steps at least; CPU within the steps' wall time (a 10 ms tick's slack)
    busy, cpu = st["step_busy_s"], st["step_cpu_s"]
    assert busy > 0 and 0 < cpu <= busy + 0.01 and st["step_runqueue_s"] >= 0
    assert server.metrics.totals["engine_step_seconds"] == busy


def test_worker_snapshot_is_in_redis_while_it_runs() -> None:
    key = stats_key("chunkserve", "w-live")

    async def run(url: str, client: redis.Redis) -> tuple[dict, int]:
        server = WorkerServer({"model": "random:tiny", "chunk_size": 16, "num_kv_chunks": 16,
                               "max_model_len": 128}, "w-live", redis_url=url, enable_ray_metrics=False)
        try:
            server.start_publishing()  # no request yet: the loop reports from the start
            for _ in range(40):
                raw = await asyncio.to_thread(client.get, key)
                if raw is not None:
                    return json.loads(raw), await asyncio.to_thread(client.pttl, key)
                await asyncio.sleep(0.1)
            return {}, -2
        finally:
            server.shutdown()

    with RedisServer() as srv:
        snap, ttl_ms = asyncio.run(run(srv.url, redis.Redis.from_url(srv.url)))
    assert snap["worker_id"] == "w-live" and snap["kv_chunks_total"] == 16
    assert snap["kv_cache_usage_perc"] == 0.0
    assert 0 < ttl_ms <= 5000  # the snapshot expires by itself if the worker dies


def test_a_stored_prompt_reaches_the_index_at_once_not_a_publish_interval_later(monkeypatch) -> None:
    import time

    from chunkserve.cluster.hashing import hash_chain
    from chunkserve.cluster.index import PrefixIndex
    from chunkserve.workers import deployment

    # a step that stores chunks wakes the publish; the interval only spaces publishes after one
    monkeypatch.setattr(deployment, "PUBLISH_INTERVAL_S", 5.0)
    monkeypatch.setattr(deployment, "STATS_INTERVAL_S", 30.0)
    prompt = tuple((7 * i + 3) % 200 + 1 for i in range(48))  # 3 full chunks of 16
    chain = hash_chain(prompt, 16)

    async def run(url: str) -> float | None:
        server = WorkerServer({"model": "random:tiny", "chunk_size": 16, "num_kv_chunks": 32,
                               "max_model_len": 128}, "w-pub", redis_url=url, enable_ray_metrics=False)
        index = PrefixIndex(url, namespace="chunkserve")
        try:
            server.start_publishing()
            await asyncio.sleep(0.5)  # the loop's first tick (stats, forest) is over: it waits
            req = GenerateRequest(request_id="r0", prompt_token_ids=prompt,
                                  sampling=SamplingParams(max_tokens=1, temperature=0.0))
            async for _ in server.generate(req):
                pass
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.0:
                held = await asyncio.to_thread(index.longest_prefixes, chain, ["w-pub"])
                if held.get("w-pub") == len(chain):
                    return time.monotonic() - t0
                await asyncio.sleep(0.02)
            return None
        finally:
            index.close()
            server.shutdown()

    with RedisServer() as srv:
        waited = asyncio.run(run(srv.url))
    assert waited is not None, "the prompt's chunks were not in the index 2 s after its request ended"
