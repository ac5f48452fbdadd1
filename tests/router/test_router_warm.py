"""The router opens its index connections and loads its scripts before the first request, in the background."""

from __future__ import annotations

import asyncio

import redis

from chunkserve.cluster.redis_server import RedisServer
from chunkserve.router.request_router import PrefixAwareRouter


def _clients(url: str) -> int:
    with redis.Redis.from_url(url) as r:
        return len(r.client_list()) - 1  # less this one


def _router(url: str, namespace: str) -> PrefixAwareRouter:
    """Serve's constructor needs a deployment; `initialize_state` is where this router sets itself up."""
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state(redis_url=url, namespace=namespace, enable_metrics=False,
                            reader={"warm_connections": 4})
    return router


def test_the_router_warms_its_index_once_as_soon_as_it_has_an_event_loop(redis_server: RedisServer,
                                                                          namespace: str) -> None:
    base = _clients(redis_server.url)
    outside = _router(redis_server.url, namespace)  # built with no running loop: nothing yet
    assert outside._warming is None

    async def go() -> bool:
        router = _router(redis_server.url, namespace)  # as Serve builds it: on its event loop
        task = router._warming
        router._start_warm()  # once
        assert task is not None and router._warming is task
        ok = await task
        assert _clients(redis_server.url) - base == 4  # its pool: open before any request
        await router._reader.aclose()
        return ok

    assert asyncio.run(go()) is True
