from __future__ import annotations

import asyncio
import logging

import pytest

from chunkserve.cluster.events import CacheEvent, WorkerPublisher
from chunkserve.cluster.hashing import hash_chain
from chunkserve.cluster.index import AsyncPrefixIndex
from chunkserve.cluster.reader import CachedIndexReader, ReaderConfig
from chunkserve.cluster.redis_server import RedisServer

CHAIN = hash_chain(list(range(32)), 4, b"s")


def _reader(url: str, namespace: str, **cfg: float) -> CachedIndexReader:
    config = ReaderConfig(**{"timeout_s": 0.5, **cfg})
    return CachedIndexReader(lambda: AsyncPrefixIndex(url, namespace=namespace, socket_timeout_s=0.3), config)


def test_lookup_is_cached_for_ttl(redis_server: RedisServer, namespace: str) -> None:
    pub = WorkerPublisher(redis_server.url, "w", namespace=namespace)
    pub.heartbeat()
    pub.publish([CacheEvent("stored", h) for h in CHAIN[:3]])

    async def go() -> None:
        reader = _reader(redis_server.url, namespace, cache_ttl_s=0.2)
        r1 = await reader.lookup(CHAIN, ["w"])
        assert (r1.status, r1.matches) == ("ok", {"w": 3})
        pub.publish([CacheEvent("stored", CHAIN[3])])
        r2 = await reader.lookup(CHAIN, ["w"])
        assert (r2.status, r2.matches) == ("cached", {"w": 3})  # stale within the TTL, by design
        await asyncio.sleep(0.25)
        r3 = await reader.lookup(CHAIN, ["w"])
        assert (r3.status, r3.matches) == ("ok", {"w": 4})
        await reader.aclose()

    asyncio.run(go())


def test_redis_down_is_reported_fast_logged_once_and_recovers(namespace: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer() as srv:
        pub = WorkerPublisher(srv.url, "w", namespace=namespace, snapshot=lambda: CHAIN[:2],
                              socket_timeout_s=0.3)
        pub.heartbeat()

        async def go() -> None:
            reader = _reader(srv.url, namespace, cache_ttl_s=0.0, retry_after_s=0.2)
            assert (await reader.lookup(CHAIN, ["w"])).matches == {"w": 2}
            srv.stop()
            with caplog.at_level(logging.WARNING, logger="chunkserve.cluster.reader"):
                statuses = [(await reader.lookup(CHAIN, ["w"])).status for _ in range(5)]
            assert statuses[0] in ("down", "timeout") and set(statuses[1:]) == {"down"}
            assert reader.is_down
            assert sum("unreachable" in r.message for r in caplog.records) == 1
            srv.start()
            pub.heartbeat()  # the worker re-acquires its lease and re-publishes its snapshot
            await asyncio.sleep(0.25)
            res = await reader.lookup(CHAIN, ["w"])
            assert (res.status, res.matches) == ("ok", {"w": 2})
            assert not reader.is_down
            await reader.aclose()

        asyncio.run(go())


def test_slow_lookup_returns_timeout_then_fills_cache(redis_server: RedisServer, namespace: str) -> None:
    pub = WorkerPublisher(redis_server.url, "w", namespace=namespace)
    pub.heartbeat()
    pub.publish([CacheEvent("stored", h) for h in CHAIN])

    async def go() -> None:
        reader = _reader(redis_server.url, namespace, timeout_s=0.0, cache_ttl_s=5.0)
        first = await reader.lookup(CHAIN, ["w"])
        assert first.status == "timeout" and first.matches is None  # never waits
        await asyncio.sleep(0.2)  # the background fetch completes and fills the cache
        second = await reader.lookup(CHAIN, ["w"])
        assert (second.status, second.matches) == ("cached", {"w": 8})
        await reader.aclose()

    asyncio.run(go())


def test_reader_without_index_reports_down() -> None:
    async def go() -> None:
        reader = CachedIndexReader(None)
        assert (await reader.lookup(CHAIN, ["w"])).status == "down"

    asyncio.run(go())


def test_async_index_modes_agree(redis_server: RedisServer, namespace: str) -> None:
    for i, n in enumerate((0, 3, 8)):
        pub = WorkerPublisher(redis_server.url, f"w{i}", namespace=namespace)
        pub.heartbeat()
        pub.publish([CacheEvent("stored", h) for h in CHAIN[:n]])

    async def go() -> list[dict[str, int]]:
        out = []
        for cluster_mode in (False, True):
            idx = AsyncPrefixIndex(redis_server.url, namespace=namespace, cluster_mode=cluster_mode)
            out.append(await idx.longest_prefixes(CHAIN, ["w0", "w1", "w2", "gone"]))
            await idx.aclose()
        return out

    single, per_worker = asyncio.run(go())
    assert single == per_worker == {"w0": 0, "w1": 3, "w2": 8}
