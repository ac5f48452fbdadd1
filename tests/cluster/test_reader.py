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


def test_routers_claiming_new_prefixes_agree_on_each_and_spread_them_evenly(redis_server: RedisServer,
                                                                            namespace: str) -> None:
    """4 new prompts, 2 routers, candidates in the same rendezvous order: rendezvous alone would put all 4
    on w1; the claims split them 2:2 by claimed chunks, and the second router follows every placement."""
    firsts = [hash_chain([t] * 16, 4, b"tenant")[0] for t in range(4)]

    async def go() -> None:
        a, b = _reader(redis_server.url, namespace), _reader(redis_server.url, namespace)
        placed = [await a.claim_cold(h, ["w1", "w2"], weight=16, ttl_s=5.0) for h in firsts]
        assert sorted(placed) == ["w1", "w1", "w2", "w2"]
        assert [await b.claim_cold(h, ["w2", "w1"], weight=16, ttl_s=5.0) for h in firsts] == placed
        # a claim whose worker is no longer a candidate (gone, or overloaded) is placed anew
        gone = placed[0]
        other = "w2" if gone == "w1" else "w1"
        assert await b.claim_cold(firsts[0], [other, "w3"], weight=16, ttl_s=5.0) == "w3"
        # a live worker passed as one of the others (overloaded: no new claims) keeps the claims it has
        assert await b.claim_cold(firsts[1], ["w4"], weight=16, ttl_s=5.0, others=["w1", "w2"]) == placed[1]
        assert await b.claim_cold(firsts[1], ["w4"], weight=16, ttl_s=5.0) == "w4"  # not live: placed anew
        await a.aclose()
        await b.aclose()

    asyncio.run(go())


def test_expired_claims_release_their_worker_and_their_weight(redis_server: RedisServer, namespace: str) -> None:
    firsts = [hash_chain([t] * 16, 4, b"exp")[0] for t in range(3)]

    async def go() -> None:
        r = _reader(redis_server.url, namespace)
        assert await r.claim_cold(firsts[0], ["w1", "w2"], weight=100, ttl_s=0.2) == "w1"
        assert await r.claim_cold(firsts[1], ["w1", "w2"], weight=1, ttl_s=5.0) == "w2"  # w1 carries 100
        await asyncio.sleep(0.3)
        # the first claim expired: w1's weight is gone (w2 now carries 1) and its prefix is free again
        assert await r.claim_cold(firsts[2], ["w1", "w2"], weight=1, ttl_s=5.0) == "w1"
        assert await r.claim_cold(firsts[0], ["w2", "w1"], weight=1, ttl_s=5.0) == "w2"
        await r.aclose()

    asyncio.run(go())


def test_a_router_whose_clock_runs_ahead_does_not_expire_other_routers_live_claims(
        redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims age by Redis's clock: a router host 10 minutes ahead must not drop w1's 100-chunk claim."""
    import time

    firsts = [hash_chain([t] * 16, 4, b"skew")[0] for t in range(2)]

    async def go() -> None:
        a, b = _reader(redis_server.url, namespace), _reader(redis_server.url, namespace)
        assert await a.claim_cold(firsts[0], ["w1", "w2"], weight=100, ttl_s=30.0) == "w1"
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 600.0)
        assert await b.claim_cold(firsts[1], ["w1", "w2"], weight=1, ttl_s=30.0) == "w2"  # w1 still carries 100
        monkeypatch.setattr(time, "time", real)
        await a.aclose()
        await b.aclose()

    asyncio.run(go())


def test_a_worker_storing_the_claimed_chains_last_chunk_settles_its_weight(redis_server: RedisServer,
                                                                          namespace: str) -> None:
    """A new prompt claimed on w1 weighs 16 chunks until w1 stores the chain's last chunk (its prefill is
    done), not a 30 s ttl: then the next new prompt goes to w1 again. A store by another worker, or of the
    chain's earlier chunks, settles nothing."""
    chains = [hash_chain([t] * 64, 4, b"settle") for t in range(3)]
    w1 = WorkerPublisher(redis_server.url, "w1", namespace=namespace)
    w2 = WorkerPublisher(redis_server.url, "w2", namespace=namespace)
    for pub in (w1, w2):
        pub.heartbeat()

    async def claim(chain: list[int], order: list[str]) -> str | None:
        r = _reader(redis_server.url, namespace)
        try:
            return await r.claim_cold(chain[0], order, weight=len(chain), ttl_s=30.0, last_hash=chain[-1])
        finally:
            await r.aclose()

    assert len(chains[0]) == 16
    assert asyncio.run(claim(chains[0], ["w1", "w2"])) == "w1"
    w2.publish([CacheEvent("stored", h) for h in chains[0]])  # w1's prompt, computed by w2: not w2's claim
    w1.publish([CacheEvent("stored", h) for h in chains[0][:-1]])  # all but the last chunk: still cold work
    assert asyncio.run(claim(chains[1], ["w1", "w2"])) == "w2"  # w1 still carries 16
    w1.publish([CacheEvent("stored", chains[0][-1])])  # done: w1 0, w2 16
    assert asyncio.run(claim(chains[2], ["w2", "w1"])) == "w1"  # without the settlement: 16:16, w2 by order
    for pub in (w1, w2):
        pub.stop(release=True)


def test_an_expired_claim_in_the_older_four_field_form_still_releases_its_weight(redis_server: RedisServer,
                                                                                namespace: str) -> None:
    """Claims written before claim settlement (``worker, weight, hash, now``: no last hash) expire as before."""
    import redis

    from chunkserve.cluster.claims import settle_keys
    from chunkserve.cluster.index import IndexKeys

    claims, load, _ = settle_keys(IndexKeys(namespace))
    client = redis.Redis.from_url(redis_server.url)
    client.zadd(claims, {"w1\t100\t12345\t0": 1})  # expired long ago
    client.hset(load, "w1", 100)
    first = hash_chain([7] * 16, 4, b"old")[0]

    async def go() -> str | None:
        r = _reader(redis_server.url, namespace)
        try:
            return await r.claim_cold(first, ["w1", "w2"], weight=1, ttl_s=5.0)
        finally:
            await r.aclose()

    assert asyncio.run(go()) == "w1"  # a 0:0 tie, the caller's order (with the old claim's 100 leaked: w2)
    assert client.hget(load, "w1") == b"1" and client.zcard(claims) == 1  # only the new claim's weight
    client.close()


def test_a_claim_without_redis_is_none_not_an_error(namespace: str) -> None:
    async def go() -> None:
        assert await CachedIndexReader(None).claim_cold(CHAIN[0], ["w1"], 4, ttl_s=1.0) is None
        with RedisServer() as srv:
            reader = _reader(srv.url, namespace, claim_timeout_s=0.2)
            srv.stop()
            assert await reader.claim_cold(CHAIN[0], ["w1"], 4, ttl_s=1.0) is None
            await reader.aclose()

    asyncio.run(go())


def _scripts_loaded(url: str) -> list[bool]:
    import hashlib

    import redis

    from chunkserve.cluster.claims import CLAIM_LUA
    from chunkserve.cluster.index import PREFIX_LEN_LUA, PREFIX_LEN_MULTI_LUA

    shas = [hashlib.sha1(s.encode()).hexdigest() for s in (PREFIX_LEN_LUA, PREFIX_LEN_MULTI_LUA, CLAIM_LUA)]
    with redis.Redis.from_url(url) as r:
        return [bool(x) for x in r.script_exists(*shas)]


def _clients(url: str) -> int:
    import redis

    with redis.Redis.from_url(url) as r:
        return len(r.client_list()) - 1  # less this one


def test_a_warmed_reader_serves_a_burst_of_lookups_and_claims_without_opening_connections_or_loading_scripts(
        namespace: str) -> None:
    with RedisServer() as srv:  # its own server: no other test's clients or scripts
        pub = WorkerPublisher(srv.url, "w", namespace=namespace)
        pub.heartbeat()
        pub.publish([CacheEvent("stored", h) for h in CHAIN[:3]])

        async def go(warm: bool) -> tuple[int, list[bool]]:
            srv_client_base = _clients(srv.url)
            reader = _reader(srv.url, namespace, warm_connections=8, cache_ttl_s=0.0)
            if warm:
                assert await reader.warm()
                assert _clients(srv.url) - srv_client_base == 8
            loaded = _scripts_loaded(srv.url)
            before = _clients(srv.url)
            chains = [hash_chain(list(range(i, i + 32)), 4, b"s") for i in range(8)]
            found = await asyncio.gather(*(reader.lookup(c, ["w"]) for c in chains))  # 8 at once, as a burst
            owners = await asyncio.gather(*(reader.claim_cold(c[0], ["w"], 8, ttl_s=1.0) for c in chains))
            assert [r.status for r in found] == ["ok"] * 8 and owners == ["w"] * 8
            opened = _clients(srv.url) - before
            await reader.aclose()
            return opened, loaded

        import redis

        with redis.Redis.from_url(srv.url) as r:
            r.script_flush()
        assert asyncio.run(go(warm=False)) == (8, [False, False, False])  # cold: opened in the burst
        with redis.Redis.from_url(srv.url) as r:
            r.script_flush()
        assert asyncio.run(go(warm=True)) == (0, [True, True, True])


def test_warming_a_reader_whose_redis_is_down_is_false_not_an_error(namespace: str) -> None:
    async def go() -> None:
        assert await CachedIndexReader(None).warm() is False
        with RedisServer() as srv:
            reader = _reader(srv.url, namespace)
            srv.stop()
            assert await reader.warm() is False
            assert reader.is_down  # the warm-up marks it down: the lookups right after do not wait on it
            assert (await reader.lookup(CHAIN, ["w"])).status == "down"
            await reader.aclose()

    asyncio.run(go())


def test_closing_a_reader_while_it_warms_cancels_the_warm_up_and_leaves_no_connection(namespace: str) -> None:
    with RedisServer() as srv:
        base = _clients(srv.url)

        async def go(delay_s: float) -> None:
            reader = _reader(srv.url, namespace, warm_connections=16)
            task = asyncio.get_running_loop().create_task(reader.warm())
            await asyncio.sleep(delay_s)
            await reader.aclose()
            assert task.done() and (task.cancelled() or task.result() in (True, False))

        for delay_s in (0.0, 0.0005, 0.001, 0.01):
            asyncio.run(go(delay_s))
        assert _clients(srv.url) == base


def test_a_reader_told_to_keep_no_warm_connections_does_not_warm(redis_server: RedisServer, namespace: str) -> None:
    async def go() -> bool:
        reader = _reader(redis_server.url, namespace, warm_connections=0)
        ok = await reader.warm()
        await reader.aclose()
        return ok

    assert asyncio.run(go()) is False
