"""Every Redis user of chunkserve on a real three-node Redis Cluster (``redis+cluster://``): the index's
publisher, lookups and sweep, cold claims, the cluster-wide rate limits, the stats snapshots and the drain
flag. Their keys carry hash tags (one slot per worker, per tenant, per namespace), and a cluster pipeline
sends scripts as bare ``EVALSHA``, so a node that lost its scripts must not break a publisher."""

from __future__ import annotations

import asyncio

import pytest
import redis

from chunkserve.cluster.drain import DrainFlag, clear_draining, mark_draining
from chunkserve.cluster.events import CacheEvent, WorkerPublisher
from chunkserve.cluster.hashing import hash_chain
from chunkserve.cluster.index import AsyncPrefixIndex, IndexKeys, PrefixIndex, is_cluster_url, redis_client
from chunkserve.cluster.reader import CachedIndexReader, ReaderConfig
from chunkserve.cluster.redis_cluster import RedisClusterServer
from chunkserve.cluster.stats import ClusterStatsReader, WorkerStatsWriter
from chunkserve.router.ratelimit import RateLimited
from chunkserve.router.ratelimit_redis import ClusterRateLimiter
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants

CHAIN = hash_chain(list(range(64)), 4, b"rc")
WORKERS = [f"w{i}" for i in range(6)]


def _node_of(client: redis.cluster.RedisCluster, key: str) -> str:
    return client.get_node_from_key(key).name


def test_cluster_urls_make_cluster_clients_and_others_plain(redis_cluster: RedisClusterServer) -> None:
    assert is_cluster_url(redis_cluster.url) and is_cluster_url("REDISS+CLUSTER://h:1")
    assert not is_cluster_url("redis://h:6379/0") and not is_cluster_url("rediss://h:6379/0")
    client = redis_client(redis_cluster.url)
    assert isinstance(client, redis.cluster.RedisCluster) and len(client.get_primaries()) == 3
    assert isinstance(redis_client("redis://127.0.0.1:1/0"), redis.Redis)


def test_workers_spread_over_the_nodes_and_lookups_sweeps_and_releases_work(
        redis_cluster: RedisClusterServer, namespace: str) -> None:
    pubs = [WorkerPublisher(redis_cluster.url, w, namespace=namespace) for w in WORKERS]
    for i, p in enumerate(pubs):
        assert p.heartbeat()  # a fresh lease: the (empty) snapshot is published
        assert p.publish([CacheEvent("stored", h) for h in CHAIN[:i + 1]]) == i + 1
    keys = IndexKeys(namespace)
    client = redis_client(redis_cluster.url)
    assert len({_node_of(client, keys.chunks(w)) for w in WORKERS}) >= 2  # really sharded
    want = {w: i + 1 for i, w in enumerate(WORKERS)}
    idx = PrefixIndex(redis_cluster.url, namespace=namespace)
    assert idx.cluster_mode and idx.longest_prefixes(CHAIN) == want

    async def lookup() -> dict[str, int]:
        aidx = AsyncPrefixIndex(redis_cluster.url, namespace=namespace)
        try:
            return await aidx.longest_prefixes(CHAIN, WORKERS)
        finally:
            await aidx.aclose()

    assert asyncio.run(lookup()) == want
    pubs[0].stop()  # graceful: lease and set gone at once
    client.delete(keys.lease(WORKERS[1]))  # a worker that died: its lease lapsed, its set is left
    assert idx.sweep() == [WORKERS[1]] and not client.exists(keys.chunks(WORKERS[1]))
    assert idx.longest_prefixes(CHAIN) == {w: want[w] for w in WORKERS[2:]}


def test_a_node_that_lost_its_scripts_does_not_break_the_publisher(redis_cluster: RedisClusterServer,
                                                                   namespace: str) -> None:
    pub = WorkerPublisher(redis_cluster.url, "w1", namespace=namespace)
    assert pub.heartbeat()
    for node in redis_cluster.servers:  # as after a node restart or a failover to a fresh replica
        redis.Redis(port=node.port).script_flush()
    assert pub.heartbeat() is False  # renewed, not re-acquired
    assert pub.publish([CacheEvent("stored", h) for h in CHAIN[:3]]) == 3  # publish + settle, one pipeline
    assert PrefixIndex(redis_cluster.url, namespace=namespace).longest_prefixes(CHAIN) == {"w1": 3}


def test_cold_claims_agree_and_settle_on_a_cluster(redis_cluster: RedisClusterServer, namespace: str) -> None:
    firsts = [hash_chain([t] * 16, 4, b"rc-claim")[0] for t in range(4)]

    def reader() -> CachedIndexReader:
        return CachedIndexReader(lambda: AsyncPrefixIndex(redis_cluster.url, namespace=namespace),
                                 ReaderConfig(timeout_s=2.0, claim_timeout_s=2.0))

    async def go() -> None:
        a, b = reader(), reader()
        placed = [await a.claim_cold(h, ["w1", "w2"], weight=16, ttl_s=30.0) for h in firsts]
        assert sorted(placed) == ["w1", "w1", "w2", "w2"]  # spread by claimed work
        assert [await b.claim_cold(h, ["w2", "w1"], weight=16, ttl_s=30.0) for h in firsts] == placed
        await a.aclose()
        await b.aclose()

    asyncio.run(go())


def test_rate_limits_are_shared_by_replicas_on_a_cluster(redis_cluster: RedisClusterServer, namespace: str) -> None:
    reg = TenantRegistry(parse_tenants({"tenants": [
        {"id": "a", "api_key_sha256": [hash_api_key("key-a")],
         "rate_limit": {"requests_per_second": 0.5, "burst_requests": 3}, "max_concurrent_requests": 2},
        {"id": "b", "api_key_sha256": [hash_api_key("key-b")]}]}))

    async def go() -> None:
        r1, r2 = (ClusterRateLimiter(reg.tenants, redis_cluster.url, namespace) for _ in range(2))
        l1 = await r1.admit("a")
        l2 = await r2.admit("a")
        with pytest.raises(RateLimited):
            await r1.admit("a")  # two running across the replicas: the third waits
        await l1.finish()
        await l2.finish()
        await (await r2.admit("a")).finish()
        with pytest.raises(RateLimited, match="requests/s"):
            await r1.admit("a")  # the burst of 3 is spent across both replicas
        await (await r1.admit("b")).finish()
        assert r1._redis_ok and r2._redis_ok  # decided by the cluster, not by the per-replica fallback
        await r1.close()
        await r2.close()

    asyncio.run(go())


def test_stats_snapshots_and_the_drain_flag_work_on_a_cluster(redis_cluster: RedisClusterServer,
                                                             namespace: str) -> None:
    pubs = [WorkerPublisher(redis_cluster.url, w, namespace=namespace) for w in WORKERS[:4]]
    for i, (w, p) in enumerate(zip(WORKERS, pubs, strict=False)):
        p.heartbeat()
        assert WorkerStatsWriter(redis_cluster.url, w, namespace).write({"kv_chunks_used": i})
    assert mark_draining(redis_cluster.url, namespace)

    async def read() -> tuple[list[dict] | None, bool]:
        stats = ClusterStatsReader(redis_cluster.url, namespace, cache_ttl_s=0.0, timeout_s=2.0)
        snaps = await stats.snapshots()
        await stats.aclose()
        return snaps, await DrainFlag(redis_cluster.url, namespace, interval_s=0.0).is_set()

    snaps, draining = asyncio.run(read())
    assert snaps is not None and sorted(s["kv_chunks_used"] for s in snaps) == [0, 1, 2, 3] and draining
    clear_draining(redis_cluster.url, namespace)
    assert asyncio.run(DrainFlag(redis_cluster.url, namespace, interval_s=0.0).is_set()) is False


def test_warming_a_reader_opens_its_connections_on_every_primary(redis_cluster: RedisClusterServer,
                                                                  namespace: str) -> None:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    name = f"warm-{namespace}"  # its own connections only: other tests' clients come and go meanwhile

    def clients() -> list[int]:  # per node
        out = []
        for srv in redis_cluster.servers:
            with redis.Redis(host=srv.host, port=srv.port) as r:
                out.append(sum(c.get("name") == name for c in r.client_list()))
        return out

    async def go() -> list[int]:
        first = redis_cluster.servers[0]
        client = AsyncRedisCluster(host=first.host, port=first.port, client_name=name)
        reader = CachedIndexReader(lambda: AsyncPrefixIndex(client, namespace=namespace),
                                   ReaderConfig(warm_connections=4))
        assert await reader.warm()
        opened = clients()
        await reader.aclose()
        return opened

    assert all(n >= 4 for n in asyncio.run(go()))


def test_warming_a_reader_whose_cluster_is_unreachable_is_false_not_an_error(namespace: str) -> None:
    from chunkserve.cluster.redis_server import find_free_port

    async def go() -> None:
        url = f"redis+cluster://127.0.0.1:{find_free_port('127.0.0.1')}"  # nothing listens there
        reader = CachedIndexReader(lambda: AsyncPrefixIndex(url, namespace=namespace, socket_timeout_s=0.3))
        assert await reader.warm() is False
        assert reader.is_down  # marked down by the warm-up itself (retried after retry_after_s), as for a plain Redis
        assert (await reader.lookup(CHAIN, WORKERS)).status == "down"  # at once: no 5 ms wait on a dead cluster
        await reader.aclose()

    asyncio.run(go())
