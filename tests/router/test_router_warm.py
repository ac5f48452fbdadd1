"""The router opens its index connections and loads its scripts before the first request, in the background."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from chunkserve.cluster.index import AsyncPrefixIndex
from chunkserve.cluster.reader import CachedIndexReader, ReaderConfig
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.router.request_router import PrefixAwareRouter


def _router(url: str, namespace: str) -> SimpleNamespace:
    reader = CachedIndexReader(lambda: AsyncPrefixIndex(url, namespace=namespace), ReaderConfig(warm_connections=4))
    return SimpleNamespace(_warming=None, _reader=reader)


def test_the_router_warms_its_index_once_as_soon_as_it_has_an_event_loop(redis_server: RedisServer,
                                                                          namespace: str) -> None:
    import redis

    with redis.Redis.from_url(redis_server.url) as r:
        base = len(r.client_list()) - 1  # less this one
    router = _router(redis_server.url, namespace)
    PrefixAwareRouter._start_warm(router)  # type: ignore[arg-type]  # no running loop: nothing yet
    assert router._warming is None

    async def go() -> bool:
        PrefixAwareRouter._start_warm(router)  # type: ignore[arg-type]
        task = router._warming
        PrefixAwareRouter._start_warm(router)  # type: ignore[arg-type]  # once
        assert task is not None and router._warming is task
        ok = await task
        with redis.Redis.from_url(redis_server.url) as r:
            assert len(r.client_list()) - 1 - base == 4  # its pool: open before any request
        await router._reader.aclose()
        return ok

    assert asyncio.run(go()) is True
