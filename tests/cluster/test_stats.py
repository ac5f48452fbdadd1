"""Worker stats snapshots in a real Redis, read by the ingress-side reader, rendered as Prometheus text."""

from __future__ import annotations

import asyncio
import time

import redis

from chunkserve.cluster.index import IndexKeys, now_ms
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.cluster.stats import ClusterStatsReader, WorkerStatsWriter, snapshot_of, stats_key
from chunkserve.router.server_metrics import ServerMetrics

STATS = {"kv_cache_usage_perc": 0.25, "kv_chunks_used": 16, "kv_chunks_cached": 8, "kv_chunks_total": 64,
         "num_requests_running": 2, "num_requests_waiting": 1, "num_preemptions": 0,
         "prompt_tokens_total": 400, "prefix_cached_tokens": 256, "sharing_ratio": "n/a"}


def test_stats_key_shares_the_workers_hash_tag() -> None:
    keys = IndexKeys("ns")
    assert stats_key("ns", "w1") == "{ns:w:w1}:stats"
    assert stats_key("ns", "w1").split("}")[0] == keys.lease("w1").split("}")[0]


def test_snapshot_keeps_only_numeric_stats_fields() -> None:
    snap = snapshot_of(STATS, "w1")
    assert snap["worker_id"] == "w1" and snap["prefix_cached_tokens"] == 256
    assert "sharing_ratio" not in snap and abs(snap["ts_ms"] - now_ms()) < 5000


def test_reader_sees_live_snapshots_until_their_ttl(redis_server: RedisServer, namespace: str) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.zadd(IndexKeys(namespace).registry, {"w1": now_ms(), "w2": now_ms(), "w3": now_ms()})
    assert WorkerStatsWriter(client, "w1", namespace, ttl_s=0.4).write(STATS)
    assert WorkerStatsWriter(client, "w2", namespace, ttl_s=30).write({**STATS, "kv_chunks_used": 48})

    async def read() -> tuple[list[dict] | None, list[dict] | None]:
        reader = ClusterStatsReader(redis_server.url, namespace, cache_ttl_s=0.0, timeout_s=1.0)
        first = await reader.snapshots()
        await asyncio.sleep(0.6)
        second = await reader.snapshots()
        await reader.aclose()
        return first, second

    first, second = asyncio.run(read())
    assert first is not None and second is not None
    assert sorted(s["worker_id"] for s in first) == ["w1", "w2"]  # w3 never wrote a snapshot
    assert {s["worker_id"]: s["kv_chunks_used"] for s in first} == {"w1": 16, "w2": 48}
    assert [s["worker_id"] for s in second] == ["w2"]  # w1's snapshot expired


def test_reader_caches_between_refreshes(redis_server: RedisServer, namespace: str) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.zadd(IndexKeys(namespace).registry, {"w1": now_ms()})
    writer = WorkerStatsWriter(client, "w1", namespace)
    writer.write(STATS)

    async def read() -> tuple[list, list, list]:
        reader = ClusterStatsReader(redis_server.url, namespace, cache_ttl_s=0.3, timeout_s=1.0)
        a = await reader.snapshots()
        writer.write({**STATS, "kv_chunks_used": 60})
        b = await reader.snapshots()
        await asyncio.sleep(0.4)
        c = await reader.snapshots()
        await reader.aclose()
        return a, b, c

    a, b, c = asyncio.run(read())
    assert a[0]["kv_chunks_used"] == 16 and b[0]["kv_chunks_used"] == 16  # cached
    assert c[0]["kv_chunks_used"] == 60


def test_slow_redis_gets_the_previous_snapshots_without_waiting(redis_server: RedisServer,
                                                                namespace: str) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.zadd(IndexKeys(namespace).registry, {"w1": now_ms()})
    writer = WorkerStatsWriter(client, "w1", namespace)
    writer.write(STATS)

    async def read() -> tuple[list, list, float, list]:
        reader = ClusterStatsReader(redis_server.url, namespace, cache_ttl_s=0.0, timeout_s=0.2)
        first = await reader.snapshots()
        await asyncio.to_thread(writer.write, {**STATS, "kv_chunks_used": 60})
        await asyncio.to_thread(client.client_pause, 800)  # the server answers nobody for 0.8 s
        t0 = time.monotonic()
        during = await reader.snapshots()
        took = time.monotonic() - t0
        await asyncio.sleep(1.0)
        after = await reader.snapshots()
        await reader.aclose()
        return first, during, took, after

    first, during, took, after = asyncio.run(read())
    assert first[0]["kv_chunks_used"] == 16
    assert during == first and took < 0.6  # the previous result, within the time budget
    assert after[0]["kv_chunks_used"] == 60  # the background fetch (or a new one) caught up


def test_reader_gives_none_quickly_without_redis() -> None:
    with RedisServer() as srv:
        url = srv.url  # a port nobody listens on once the server has stopped

    async def read() -> tuple[list | None, float]:
        reader = ClusterStatsReader(url, cache_ttl_s=1.0, timeout_s=0.2)
        t0 = time.monotonic()
        out = await reader.snapshots()
        return out, time.monotonic() - t0

    out, took = asyncio.run(read())
    assert out is None and took < 1.0
    assert not WorkerStatsWriter(url, "w1", socket_timeout_s=0.2).write(STATS)  # logged, not raised


def test_server_metrics_render_each_worker_and_the_cluster_usage() -> None:
    m = ServerMetrics("tiny")
    assert b"chunkserve:worker_" not in m.render()  # no cluster source: nothing rendered
    m.set_cluster([snapshot_of(STATS, "w1"), snapshot_of({**STATS, "kv_chunks_used": 48}, "w2")])
    text = m.render().decode()
    assert 'chunkserve:worker_kv_chunks_used{model_name="tiny",worker_id="w2"} 48.0' in text
    assert 'chunkserve:worker_prefix_cache_hits_total{model_name="tiny",worker_id="w1"} 256.0' in text
    assert 'chunkserve:worker_prefix_cache_queries_total{model_name="tiny",worker_id="w1"} 400.0' in text
    assert 'chunkserve:kv_cache_usage_perc{model_name="tiny"} 0.5' in text  # (16 + 48) / (64 + 64)
    assert 'chunkserve:workers_reporting{model_name="tiny"} 2.0' in text
    assert 'chunkserve:cluster_stats_up{model_name="tiny"} 1.0' in text
    m.set_cluster(None)  # Redis down: marked down, no stale cluster usage
    text = m.render().decode()
    assert 'chunkserve:cluster_stats_up{model_name="tiny"} 0.0' in text
    assert "chunkserve:kv_cache_usage_perc{" not in text and "worker_id=" not in text


def _ingress(reader: ClusterStatsReader | None) -> object:
    from chunkserve.router.ingress import Ingress, IngressConfig
    from chunkserve.router.tenants import TenantRegistry

    return Ingress(object(), None, TenantRegistry(None), IngressConfig("tiny", 128, 16, vocab_size=100),
                   cluster_stats=reader)


def test_ingress_metrics_show_the_workers_from_redis(redis_server: RedisServer, namespace: str) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.zadd(IndexKeys(namespace).registry, {"w1": now_ms()})
    WorkerStatsWriter(client, "w1", namespace).write(STATS)
    ingress = _ingress(ClusterStatsReader(redis_server.url, namespace, timeout_s=5.0))
    asyncio.run(ingress.refresh_metrics())
    text = ingress.metrics.render().decode()
    assert 'chunkserve:worker_prefix_cache_hits_total{model_name="tiny",worker_id="w1"} 256.0' in text
    assert 'chunkserve:kv_cache_usage_perc{model_name="tiny"} 0.25' in text


def test_ingress_metrics_fall_back_when_redis_is_down() -> None:
    with RedisServer() as srv:
        url = srv.url
    ingress = _ingress(ClusterStatsReader(url, timeout_s=0.2))
    t0 = time.monotonic()
    asyncio.run(ingress.refresh_metrics())
    assert time.monotonic() - t0 < 1.0
    text = ingress.metrics.render().decode()
    assert 'chunkserve:cluster_stats_up{model_name="tiny"} 0.0' in text
    assert "chunkserve:prefix_cache_hits" in text  # the ingress's own metrics still render
