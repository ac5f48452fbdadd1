from __future__ import annotations

import time

import pytest
import redis

from chunkserve.cluster.events import CacheEvent, WorkerPublisher
from chunkserve.cluster.hashing import hash_chain
from chunkserve.cluster.index import IndexKeys, PrefixIndex, decode_hash, encode_hash
from chunkserve.cluster.redis_server import RedisServer


def _chain(seed: int, n_chunks: int = 8, chunk: int = 4) -> list[int]:
    return hash_chain([seed * 1000 + i for i in range(n_chunks * chunk)], chunk, b"tenant")


def test_hash_encoding_round_trips_full_u64_range() -> None:
    for h in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert decode_hash(encode_hash(h)) == h
    with pytest.raises(ValueError):
        encode_hash(1 << 64)


def test_keys_of_one_worker_share_a_cluster_slot() -> None:
    from redis.crc import key_slot

    k = IndexKeys("ns")
    assert key_slot(k.lease("w1").encode()) == key_slot(k.chunks("w1").encode())
    assert k.lease("w1").startswith("{ns:w:w1}")


def test_longest_prefix_per_worker(redis_server: RedisServer, namespace: str) -> None:
    chain = _chain(1)
    a = WorkerPublisher(redis_server.url, "a", namespace=namespace)
    b = WorkerPublisher(redis_server.url, "b", namespace=namespace)
    a.heartbeat()
    b.heartbeat()
    assert a.publish([CacheEvent("stored", h) for h in chain[:6]]) == 6
    assert b.publish([CacheEvent("stored", h) for h in chain[:2]] + [CacheEvent("stored", chain[3])]) == 3
    idx = PrefixIndex(redis_server.url, namespace=namespace)
    assert idx.longest_prefixes(chain) == {"a": 6, "b": 2}  # b's chunk 3 is not a prefix
    assert idx.longest_prefixes(_chain(2), ["a", "b"]) == {"a": 0, "b": 0}
    assert sorted(idx.live_workers()) == ["a", "b"]


def test_evict_and_clear_shorten_matches(redis_server: RedisServer, namespace: str) -> None:
    chain = _chain(3)
    pub = WorkerPublisher(redis_server.url, "w", namespace=namespace)
    pub.heartbeat()
    pub.publish([CacheEvent("stored", h) for h in chain])
    idx = PrefixIndex(redis_server.url, namespace=namespace)
    pub.publish([CacheEvent("evicted", chain[4])])
    assert idx.longest_prefixes(chain, ["w"]) == {"w": 4}
    # One batch, applied in order: clear, then store the first two again.
    pub.publish([CacheEvent("cleared", 0), CacheEvent("stored", chain[0]), CacheEvent("stored", chain[1])])
    assert idx.longest_prefixes(chain, ["w"]) == {"w": 2}
    assert idx.worker_hashes("w") == set(chain[:2])


def test_publish_drops_stored_chunks_deeper_than_bound(redis_server: RedisServer, namespace: str) -> None:
    chain = _chain(4)
    pub = WorkerPublisher(redis_server.url, "w", namespace=namespace, max_depth=3)
    pub.heartbeat()
    pub.publish([CacheEvent("stored", h, depth=i) for i, h in enumerate(chain)])
    assert PrefixIndex(redis_server.url, namespace=namespace).worker_hashes("w") == set(chain[:3])


def test_expired_lease_is_ignored_at_once_and_purged(redis_server: RedisServer, namespace: str) -> None:
    chain = _chain(5)
    pub = WorkerPublisher(redis_server.url, "w", namespace=namespace, lease_ttl_s=0.3)
    pub.heartbeat()
    pub.publish([CacheEvent("stored", h) for h in chain])
    idx = PrefixIndex(redis_server.url, namespace=namespace)
    assert idx.longest_prefixes(chain, ["w"]) == {"w": 8}
    time.sleep(0.4)
    assert idx.longest_prefixes(chain, ["w"]) == {}  # lease gone -> ignored ...
    assert not idx.client.exists(idx.keys.chunks("w"))  # ... and its set purged by the lookup
    assert idx.live_workers() == []
    assert pub.publish([CacheEvent("stored", chain[0])]) == -1  # a lapsed worker cannot write


def test_sweeper_purges_dead_workers_only(redis_server: RedisServer, namespace: str) -> None:
    dead = WorkerPublisher(redis_server.url, "dead", namespace=namespace, lease_ttl_s=0.2)
    live = WorkerPublisher(redis_server.url, "live", namespace=namespace, lease_ttl_s=5.0)
    for p in (dead, live):
        p.heartbeat()
        p.publish([CacheEvent("stored", h) for h in _chain(6)])
    time.sleep(0.3)
    idx = PrefixIndex(redis_server.url, namespace=namespace)
    assert idx.sweep() == ["dead"]
    assert not idx.client.exists(idx.keys.chunks("dead"))
    assert idx.worker_hashes("live") == set(_chain(6))


def test_live_workers_sweep_dead_ones_in_their_heartbeat(redis_server: RedisServer, namespace: str) -> None:
    dead = WorkerPublisher(redis_server.url, "dead", namespace=namespace, lease_ttl_s=0.2)
    dead.heartbeat()
    dead.publish([CacheEvent("stored", h) for h in _chain(12)])
    live = WorkerPublisher(redis_server.url, "live", namespace=namespace, sweep_every_s=0.1)
    live.heartbeat()
    time.sleep(0.3)
    idx = PrefixIndex(redis_server.url, namespace=namespace)
    assert idx.client.exists(idx.keys.chunks("dead"))  # nobody looked it up yet: still there
    live.heartbeat()
    assert not idx.client.exists(idx.keys.chunks("dead"))
    assert idx.client.zrange(idx.keys.registry, 0, -1) == [b"live"]


def test_lost_lease_is_reacquired_with_snapshot(redis_server: RedisServer, namespace: str) -> None:
    chain = _chain(7)
    held = set(chain[:5])
    pub = WorkerPublisher(redis_server.url, "w", namespace=namespace, lease_ttl_s=0.2, snapshot=lambda: held)
    assert pub.heartbeat() is True  # first acquisition publishes the snapshot
    assert pub.heartbeat() is False  # plain renewal
    time.sleep(0.3)
    idx = PrefixIndex(redis_server.url, namespace=namespace)
    assert idx.longest_prefixes(chain, ["w"]) == {}
    assert pub.heartbeat() is True
    assert idx.longest_prefixes(chain, ["w"]) == {"w": 5}


def test_background_heartbeat_keeps_lease_and_release_drops_entries(redis_server: RedisServer,
                                                                   namespace: str) -> None:
    chain = _chain(8)
    pub = WorkerPublisher(redis_server.url, "w", namespace=namespace, lease_ttl_s=0.3).start()
    pub.publish([CacheEvent("stored", h) for h in chain])
    time.sleep(0.7)  # > 2 TTLs: only the heartbeat thread keeps it alive
    idx = PrefixIndex(redis_server.url, namespace=namespace)
    assert idx.longest_prefixes(chain, ["w"]) == {"w": 8}
    pub.stop(release=True)
    assert idx.longest_prefixes(chain, ["w"]) == {}
    assert idx.live_workers() == []


@pytest.mark.parametrize("cluster_mode", [False, True])
def test_lookup_is_one_round_trip_for_all_workers(redis_server: RedisServer, namespace: str,
                                                  monkeypatch: pytest.MonkeyPatch, cluster_mode: bool) -> None:
    chain = _chain(9)
    for i in range(8):
        p = WorkerPublisher(redis_server.url, f"w{i}", namespace=namespace)
        p.heartbeat()
        p.publish([CacheEvent("stored", h) for h in chain[:i]])
    p.stop(release=True)  # w7's lease is gone: it must be left out
    client = redis.Redis.from_url(redis_server.url)
    idx = PrefixIndex(client, namespace=namespace, cluster_mode=cluster_mode)
    workers = [f"w{i}" for i in range(8)]
    expected = {f"w{i}": i for i in range(7)}
    assert idx.longest_prefixes(chain, workers) == expected  # loads the scripts on first use
    sends: list[int] = []
    orig = redis.connection.Connection.send_packed_command

    def counting(self: redis.connection.Connection, command: object, check_health: bool = True) -> None:
        sends.append(1)
        orig(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
    before = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    sends.clear()
    assert idx.longest_prefixes(chain, workers) == expected
    assert len(sends) == 1  # one write of the whole request: one round trip
    after = client.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert after - before == (8 if cluster_mode else 1)


def test_publisher_survives_redis_restart_and_resyncs(namespace: str) -> None:
    chain = _chain(10)
    held = set(chain)
    with RedisServer() as srv:
        pub = WorkerPublisher(srv.url, "w", namespace=namespace, snapshot=lambda: held,
                              socket_timeout_s=0.3)
        pub.heartbeat()
        srv.stop()
        assert pub.publish([CacheEvent("stored", chain[0])]) == -1  # no exception escapes
        assert pub.heartbeat() is False
        srv.start()  # comes back empty
        assert pub.heartbeat() is True
        idx = PrefixIndex(srv.url, namespace=namespace)
        assert idx.longest_prefixes(chain, ["w"]) == {"w": 8}
        idx.close()


def test_cache_event_validates_input() -> None:
    with pytest.raises(ValueError):
        CacheEvent("inserted", 1)
    with pytest.raises(ValueError):
        CacheEvent("stored", -1)


def test_resync_during_concurrent_publishes_converges_to_cache_state(redis_server: RedisServer,
                                                                     namespace: str) -> None:
    import random
    import threading

    pool = _chain(11, n_chunks=64, chunk=2)
    held: dict[int, None] = {}
    def slow_snapshot() -> list[int]:  # widen the window between reading the cache and writing Redis
        copy = list(held)
        time.sleep(0.01)
        return copy

    pub = WorkerPublisher(redis_server.url, "w", namespace=namespace, snapshot=slow_snapshot)
    pub.heartbeat()
    idx = PrefixIndex(redis_server.url, namespace=namespace)
    stop = threading.Event()

    def engine() -> None:  # mutate the cache, then publish the step's events (as a worker does)
        rng = random.Random(0)
        while not stop.is_set():
            events = []
            for _ in range(4):
                h = rng.choice(pool)
                if h in held:
                    del held[h]
                    events.append(CacheEvent("evicted", h))
                else:
                    held[h] = None
                    events.append(CacheEvent("stored", h))
            pub.publish(events)

    t = threading.Thread(target=engine)
    t.start()
    for _ in range(15):  # force lease loss -> the next heartbeat re-publishes the snapshot
        idx.client.delete(idx.keys.lease("w"))
        pub.heartbeat()
    stop.set()
    t.join()
    pub.heartbeat()
    assert idx.worker_hashes("w") == set(held)
