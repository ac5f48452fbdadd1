"""PrefixAwareRouter inside a real Ray Serve app, with a real Redis index.

The deployment defined here stands in for a worker: it keeps the chunk hashes of the prompts it served
in a set, publishes them to the index under its Ray replica id, and returns that id and its hit count.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from chunkserve.cluster.events import CacheEvent, WorkerPublisher
from chunkserve.cluster.hashing import hash_chain
from chunkserve.cluster.index import PrefixIndex
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.router.policy import rendezvous_weight
from chunkserve.router.request_router import extract_chain

pytestmark = pytest.mark.slow

NS = "raytest"
CHUNK = 64
LEASE_TTL_S = 2.0
CAPACITY = 20  # chunks per replica: two 8-chunk tenant prompts fit, four do not


@serve.deployment(num_replicas=2, max_ongoing_requests=32, ray_actor_options={"num_cpus": 0})
class PrefixEcho:
    """A stand-in worker whose cache is an LRU of ``capacity`` chunk hashes."""

    def __init__(self, redis_url: str, namespace: str = NS, capacity: int = CAPACITY) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.capacity = capacity
        self.held: OrderedDict[int, None] = OrderedDict()
        self.pub = WorkerPublisher(redis_url, self.replica_id, namespace=namespace, lease_ttl_s=LEASE_TTL_S,
                                   snapshot=lambda: list(self.held)).start()

    async def __call__(self, chunk_hashes: list[int] | None = None, store: list[int] | None = None,
                       delay_s: float = 0.0) -> dict[str, Any]:
        chain = list(chunk_hashes or store or [])
        hit = next((i for i, h in enumerate(chain) if h not in self.held), len(chain))
        events = []
        for i, h in enumerate(chain):
            if h in self.held:
                self.held.move_to_end(h)
            else:
                self.held[h] = None
                events.append(CacheEvent("stored", h, depth=i))
        while len(self.held) > self.capacity:
            events.append(CacheEvent("evicted", self.held.popitem(last=False)[0]))
        await asyncio.to_thread(self.pub.publish, events)  # one round trip per "engine step"
        if delay_s:
            await asyncio.sleep(delay_s)
        return {"replica": self.replica_id, "hit": hit, "actor": ray.get_runtime_context().current_actor}


@pytest.fixture(scope="module")
def app(redis_server: RedisServer) -> Iterator[Any]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        router_cfg = RequestRouterConfig(
            request_router_class="chunkserve.router.request_router.PrefixAwareRouter",
            request_router_kwargs={"redis_url": redis_server.url, "namespace": NS,
                                   "policy": {"spill_abs": 3, "spill_rel": 1.5},
                                   "reader": {"timeout_s": 0.5}},
        )
        handle = serve.run(PrefixEcho.options(request_router_config=router_cfg).bind(redis_server.url),
                           name="prefix-echo", route_prefix=None)
        yield handle
    finally:
        serve.shutdown()
        ray.shutdown()


def _tenant_chain(tenant: int, n_tokens: int = 512) -> list[int]:
    return hash_chain([tenant * 7919 + i for i in range(n_tokens)], CHUNK, f"tenant-{tenant}".encode())


def _call(handle: Any, **kw: Any) -> dict[str, Any]:
    return handle.remote(**kw).result(timeout_s=30)


def test_extract_chain_reads_kwarg_attribute_and_dict() -> None:
    class Req:
        def __init__(self, args: list[Any], kwargs: dict[str, Any]) -> None:
            self.args, self.kwargs = args, kwargs

    class Prompt:
        chunk_hashes = [5, 6, 7]

    assert extract_chain(Req([], {"chunk_hashes": [1, 2, 3]}), 2) == [1, 2]  # type: ignore[arg-type]
    assert extract_chain(Req([Prompt()], {}), 8) == [5, 6, 7]  # type: ignore[arg-type]
    assert extract_chain(Req([{"chunk_hashes": [9]}], {}), 8) == [9]  # type: ignore[arg-type]
    assert extract_chain(Req(["text"], {"chunk_hashes": ["x"]}), 8) == []  # type: ignore[arg-type]
    assert extract_chain(Req([], {"chunk_hashes": [1, 1 << 64]}), 8) == []  # type: ignore[arg-type]  (not a hash)
    assert extract_chain(Req([], {"chunk_hashes": [(1 << 64) - 1]}), 8) == [(1 << 64) - 1]  # type: ignore[arg-type]


def _run_tenants(handle: Any, tenants: list[list[int]], n: int) -> tuple[dict[int, list[str]], float]:
    """Send ``n`` requests over the tenants in a fixed random order; -> placements, hit rate / oracle's."""
    order = list(range(len(tenants))) + random.Random(5).choices(range(len(tenants)), k=n - len(tenants))
    placed: dict[int, list[str]] = defaultdict(list)
    hits = oracle = 0
    for i, t in enumerate(order):
        out = _call(handle, chunk_hashes=tenants[t])
        placed[t].append(out["replica"])
        hits += out["hit"]
        oracle += len(tenants[t]) if i >= len(tenants) else 0  # an infinite shared cache misses once
    return placed, hits / oracle


def test_same_chain_lands_on_the_replica_holding_it_and_beats_p2c(app: Any, redis_server: RedisServer) -> None:
    idx = PrefixIndex(redis_server.url, namespace=NS)
    replicas = sorted(idx.live_workers())
    assert len(replicas) == 2
    # 4 tenants whose rendezvous owners split 2/2, so each replica's cache holds its tenants' prompts.
    owners: dict[str, list[list[int]]] = defaultdict(list)
    for s in range(200, 260):
        c = _tenant_chain(s)
        owner = max(replicas, key=lambda r, c=c: rendezvous_weight(c[0], r))
        if len(owners[owner]) < 2:
            owners[owner].append(c)
    tenants = [c for r in replicas for c in owners[r]]
    assert len(tenants) == 4
    placed, rate = _run_tenants(app, tenants, 40)
    for t, reps in placed.items():
        assert all(r == reps[0] for r in reps[1:]), f"tenant {t} moved between replicas: {Counter(reps)}"
    assert rate >= 0.9
    # Replicas publish under serve.get_replica_context().replica_id.unique_id, and the index knows them.
    assert {r for reps in placed.values() for r in reps} <= set(replicas)
    idx.close()
    # The same workload through Serve's default power-of-two-choices router.
    p2c = serve.run(PrefixEcho.bind(redis_server.url, "p2c-baseline"), name="p2c-echo", route_prefix=None)
    try:
        _, p2c_rate = _run_tenants(p2c, tenants, 40)
    finally:
        serve.delete("p2c-echo")
    print(f"hit rate vs oracle: prefix-aware {rate:.2f}, p2c {p2c_rate:.2f}")
    assert p2c_rate < 0.75 * rate, (p2c_rate, rate)


def test_index_entry_overrides_rendezvous(app: Any, redis_server: RedisServer) -> None:
    """Proves the router maps RunningReplica ids to the ids workers publish under."""
    idx = PrefixIndex(redis_server.url, namespace=NS)
    a, b = sorted(idx.live_workers())
    # Store a cold chain on whichever replica takes it (no chain -> least loaded), until the replica
    # holding it is *not* the chain's rendezvous owner.
    for s in range(100, 120):
        chain = _tenant_chain(s)
        holder = _call(app, store=chain)["replica"]
        other = b if holder == a else a
        if rendezvous_weight(chain[0], other) > rendezvous_weight(chain[0], holder):
            break
    else:
        raise AssertionError("no chain whose rendezvous owner differs from its holder")
    assert idx.longest_prefixes(chain, [holder, other]) == {holder: len(chain), other: 0}
    assert _call(app, chunk_hashes=chain)["replica"] == holder  # not the rendezvous owner `other`
    idx.close()


def test_hot_tenant_spills_to_the_other_replica(app: Any) -> None:
    hot = _tenant_chain(7)
    _call(app, chunk_hashes=hot)  # warm one replica
    responses = [app.remote(chunk_hashes=hot, delay_s=0.5) for _ in range(16)]
    served = Counter(r.result(timeout_s=30)["replica"] for r in responses)
    assert len(served) == 2, f"hot tenant never spilled: {served}"
    assert max(served.values()) <= 0.8 * 16


def test_requests_survive_redis_outage_and_index_refills(app: Any, redis_server: RedisServer) -> None:
    chain = _tenant_chain(77)
    first = _call(app, chunk_hashes=chain)["replica"]
    redis_server.stop()
    during = [_call(app, chunk_hashes=chain) for _ in range(4)]  # routed by rendezvous + hints
    assert all(isinstance(r["replica"], str) for r in during), during
    redis_server.start()  # comes back empty
    idx = PrefixIndex(redis_server.url, namespace=NS)
    t0 = time.monotonic()
    while len(idx.live_workers()) < 2 and time.monotonic() - t0 < 3 * LEASE_TTL_S:
        time.sleep(0.1)
    # Heartbeats re-acquired the leases and re-published each replica's snapshot.
    assert idx.longest_prefixes(chain, [first]) == {first: len(chain)}
    time.sleep(1.2)  # the router's retry window (ReaderConfig.retry_after_s) passes
    holders = {w for w, n in idx.longest_prefixes(chain, idx.live_workers()).items() if n == len(chain)}
    assert first in holders and _call(app, chunk_hashes=chain)["replica"] in holders
    idx.close()


def test_killed_replica_entries_are_ignored_within_lease_ttl(app: Any, redis_server: RedisServer) -> None:
    chain = _tenant_chain(42)
    out = _call(app, chunk_hashes=chain)
    victim = out["replica"]
    idx = PrefixIndex(redis_server.url, namespace=NS)
    assert idx.longest_prefixes(chain, [victim]) == {victim: len(chain)}
    ray.kill(out["actor"], no_restart=True)
    t0 = time.monotonic()
    while idx.longest_prefixes(chain, [victim]) and time.monotonic() - t0 < 3 * LEASE_TTL_S:
        time.sleep(0.1)
    assert idx.longest_prefixes(chain, [victim]) == {}
    assert time.monotonic() - t0 <= LEASE_TTL_S + 1.0
    # Requests keep succeeding on the surviving / replacement replica; none hangs.
    results = [_call(app, chunk_hashes=chain) for _ in range(3)]
    assert all(r["replica"] != victim for r in results)
    idx.close()
