"""Router benchmark: decision latency, and cluster hit rate of prefix-aware vs round-robin vs P2C routing.

Starts a real redis-server. Part 1 fills the index with ``--prefixes`` distinct prompt prefixes spread
over ``--replicas`` workers and times full routing decisions (async index lookup with the cache off, so
every decision pays its Redis round trip, plus the policy), p50/p99. Part 2 replays one multi-tenant
trace (Zipf tenant popularity, per-tenant system prompts, unique user turns) through simulated workers
whose caches are bounded LRUs of chunk hashes that publish real stored/evicted events to the index, and
routes it three ways. Prints a table and writes JSON.

    .venv/bin/python benchmarks/bench_router.py --json bench_router.json
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import os
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from chunkserve.cluster.events import CacheEvent, WorkerPublisher
from chunkserve.cluster.hashing import hash_chain
from chunkserve.cluster.index import AsyncPrefixIndex, PrefixIndex
from chunkserve.cluster.reader import CachedIndexReader, ReaderConfig
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.router.policy import PolicyConfig, PrefixPolicy, ReplicaLoad

CHUNK = 64


# -- part 1: decision latency ----------------------------------------------------------------------
def bench_latency(url: str, replicas: int, prefixes: int, chunks_per_prefix: int, queries: int,
                  seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    ids = [f"replica-{i}" for i in range(replicas)]
    pubs = [WorkerPublisher(url, w, namespace="lat", lease_ttl_s=600.0) for w in ids]
    for p in pubs:
        p.heartbeat()
    chains = [hash_chain(np.arange(chunks_per_prefix * CHUNK) + 1_000_003 * i, CHUNK, b"lat")
              for i in range(prefixes)]
    owned: list[list[CacheEvent]] = [[] for _ in ids]
    for c in chains:
        for w in rng.sample(range(replicas), 2):
            depth = rng.randint(1, len(c))
            owned[w].extend(CacheEvent("stored", h, depth=d) for d, h in enumerate(c[:depth]))
    for p, evs in zip(pubs, owned, strict=True):
        for i in range(0, len(evs), 5000):
            p.publish(evs[i:i + 5000])
    entries = sum(len(PrefixIndex(url, namespace="lat").worker_hashes(w)) for w in ids)

    async def run(cache_ttl_s: float) -> list[float]:
        """Decision times; with a cache, the time of a repeat decision (served from the local cache)."""
        reader = CachedIndexReader(lambda: AsyncPrefixIndex(url, namespace="lat", max_chunks=64),
                                   ReaderConfig(cache_ttl_s=cache_ttl_s, timeout_s=0.05))
        policy = PrefixPolicy()
        out: list[float] = []
        for q in range(queries + 200):
            chain = chains[rng.randrange(prefixes)] if q % 10 else hash_chain([q] * CHUNK * 4, CHUNK, b"cold")
            loads = [ReplicaLoad(w, rng.randint(0, 6), 32) for w in ids]
            for _ in range(2 if cache_ttl_s > 0 else 1):
                t0 = time.perf_counter()
                res = await reader.lookup(chain, ids)
                d = policy.decide(loads, chain, res.matches)
                policy.record(chain, d.replica_id)
                dt = time.perf_counter() - t0
            if q >= 200:  # warm-up: connection pool, script cache
                out.append(dt)
        await reader.aclose()
        return out

    async def ping_times() -> list[float]:
        idx = AsyncPrefixIndex(url, namespace="lat")
        out = []
        for q in range(queries + 200):
            t0 = time.perf_counter()
            await idx.ping()
            if q >= 200:
                out.append(time.perf_counter() - t0)
        await idx.aclose()
        return out

    admin = PrefixIndex(url, namespace="lat").client
    ping = np.array(asyncio.run(ping_times())) * 1e3
    admin.config_resetstat()
    miss = np.array(asyncio.run(run(0.0))) * 1e3
    stats = admin.info("commandstats").get("cmdstat_evalsha", {"calls": 1, "usec": 0})
    server_us = stats["usec"] / (queries + 200)  # Redis CPU per lookup (all replicas; one script call)
    hit = np.array(asyncio.run(run(60.0))) * 1e3
    for p in pubs:
        p.stop(release=True)
    return {"replicas": replicas, "prefixes": prefixes, "index_entries": entries, "queries": queries,
            "p50_ms": float(np.percentile(miss, 50)), "p99_ms": float(np.percentile(miss, 99)),
            "cached_p50_ms": float(np.percentile(hit, 50)), "cached_p99_ms": float(np.percentile(hit, 99)),
            "redis_server_us_per_lookup": server_us,
            "ping_p50_ms": float(np.percentile(ping, 50)), "ping_p99_ms": float(np.percentile(ping, 99)),
            "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}


# -- part 2: hit rate on a multi-tenant trace -------------------------------------------------------
@dataclass
class SimWorker:
    """A worker's prefix cache as a bounded LRU of chunk hashes; publishes real index events."""

    wid: str
    capacity: int
    pub: WorkerPublisher | None
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    done: list[float] = field(default_factory=list)  # completion times of ongoing requests (heap)

    def serve(self, chain: list[int]) -> int:
        hit = next((i for i, h in enumerate(chain) if h not in self.lru), len(chain))
        events: list[CacheEvent] = []
        for d, h in enumerate(chain):
            if h in self.lru:
                self.lru.move_to_end(h)
            else:
                self.lru[h] = None
                events.append(CacheEvent("stored", h, depth=d))
        while len(self.lru) > self.capacity:
            events.append(CacheEvent("evicted", self.lru.popitem(last=False)[0]))
        if self.pub is not None and events:
            self.pub.publish(events)  # one round trip per "engine step"
        return hit

    def load(self, now: float) -> int:
        while self.done and self.done[0] <= now:
            heapq.heappop(self.done)
        return len(self.done)


def make_trace(tenants: int, requests: int, seed: int) -> list[tuple[int, list[int]]]:
    """(tenant, chunk hash chain) per request: tenant system prompt (2-12 chunks) + 1-3 unique chunks."""
    rng = np.random.default_rng(seed)
    sys_len = rng.integers(2, 13, size=tenants)
    weights = 1.0 / np.arange(1, tenants + 1) ** 1.1
    picks = rng.choice(tenants, size=requests, p=weights / weights.sum())
    trace = []
    for i, t in enumerate(picks):
        system = np.arange(int(sys_len[t]) * CHUNK) + 10_000_019 * int(t)
        user = rng.integers(0, 50_000, size=int(rng.integers(1, 4)) * CHUNK) + 7 * i
        trace.append((int(t), hash_chain(np.concatenate([system, user]), CHUNK, f"t{t}".encode())))
    return trace


Router = Callable[[list[SimWorker], list[int], float], SimWorker]


def simulate(trace: list[tuple[int, list[int]]], workers: list[SimWorker], route: Router,
             rate: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    now = 0.0
    hits = total = 0
    served: Counter[str] = Counter()
    for _, chain in trace:
        now += rng.expovariate(rate)
        w = route(workers, chain, now)
        hit = w.serve(chain)
        hits += hit
        total += len(chain)
        served[w.wid] += 1
        service = 0.05 + 0.02 * (len(chain) - hit)  # prefill of uncached chunks + a short decode
        start = max(now, w.done[0] if len(w.done) >= 8 else now)  # 8 slots per worker
        heapq.heappush(w.done, start + service)
    counts = [served[w.wid] for w in workers]
    return {"hit_rate": hits / total, "max_share": max(counts) / len(trace),
            "imbalance": max(counts) / (sum(counts) / len(counts))}


def bench_hit_rate(url: str, replicas: int, tenants: int, requests: int, capacity: int, rate: float,
                   seed: int) -> dict[str, dict[str, float]]:
    trace = make_trace(tenants, requests, seed)
    seen: set[int] = set()
    oracle_hits = 0
    for _, chain in trace:  # one infinite cache: every chunk seen before is a hit
        oracle_hits += next((i for i, h in enumerate(chain) if h not in seen), len(chain))
        seen.update(chain)
    results: dict[str, dict[str, float]] = {}
    total_chunks = sum(len(c) for _, c in trace)
    results["oracle"] = {"hit_rate": oracle_hits / total_chunks, "max_share": float("nan"),
                         "imbalance": float("nan")}

    rr = itertools.count()
    p2c_rng = random.Random(seed + 1)
    vclock = [0.0]
    policy = PrefixPolicy(PolicyConfig(spill_abs=4, spill_rel=2.0, hint_ttl_s=2.0), clock=lambda: vclock[0])
    index = PrefixIndex(url, namespace="sim-prefix", max_chunks=64)
    reasons: Counter[str] = Counter()

    def prefix_route(ws: list[SimWorker], chain: list[int], now: float) -> SimWorker:
        vclock[0] = now
        matches = index.longest_prefixes(chain, [w.wid for w in ws])
        d = policy.decide([ReplicaLoad(w.wid, w.load(now), 8) for w in ws], chain, matches)
        policy.record(chain, d.replica_id)
        reasons[d.reason] += 1
        return next(w for w in ws if w.wid == d.replica_id)

    def rr_route(ws: list[SimWorker], chain: list[int], now: float) -> SimWorker:
        return ws[next(rr) % len(ws)]

    def p2c_route(ws: list[SimWorker], chain: list[int], now: float) -> SimWorker:
        a, b = p2c_rng.sample(ws, 2)
        return a if a.load(now) <= b.load(now) else b

    for name, route in (("prefix_aware", prefix_route), ("round_robin", rr_route), ("pow2_choices", p2c_route)):
        ns = f"sim-{name.split('_')[0]}"
        ws = [SimWorker(f"w{i}", capacity, WorkerPublisher(url, f"w{i}", namespace=ns, lease_ttl_s=600.0)
                        if name == "prefix_aware" else None) for i in range(replicas)]
        for w in ws:
            if w.pub is not None:
                w.pub.heartbeat()
        results[name] = simulate(trace, ws, route, rate, seed)
        for w in ws:
            if w.pub is not None:
                w.pub.stop(release=True)
    results["prefix_aware"]["reasons"] = dict(reasons)  # type: ignore[assignment]
    results["prefix_aware"]["of_oracle"] = results["prefix_aware"]["hit_rate"] / results["oracle"]["hit_rate"]
    index.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--prefixes", type=int, default=10_000)
    ap.add_argument("--chunks-per-prefix", type=int, default=16)
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--sim-replicas", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--capacity", type=int, default=120, help="chunks per simulated worker cache")
    ap.add_argument("--rate", type=float, default=40.0, help="arrivals per (virtual) second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_router.json")
    args = ap.parse_args()
    with RedisServer() as srv:
        lat = bench_latency(srv.url, args.replicas, args.prefixes, args.chunks_per_prefix, args.queries,
                            args.seed)
        hr = bench_hit_rate(srv.url, args.sim_replicas, args.tenants, args.requests, args.capacity,
                            args.rate, args.seed)
    print(f"\nRouter decision latency ({lat['replicas']} replicas, {lat['prefixes']} prefixes, "
          f"{lat['index_entries']} index entries, {lat['queries']} decisions; "
          f"load avg {lat['load_avg_1m']:.1f} on {lat['cpus']} CPUs)")
    print(f"  {'path':<28}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"  {'Redis round trip + policy':<28}{lat['p50_ms']:>10.3f}{lat['p99_ms']:>10.3f}")
    print(f"  {'local cache hit + policy':<28}{lat['cached_p50_ms']:>10.3f}{lat['cached_p99_ms']:>10.3f}")
    print(f"  {'bare PING (baseline)':<28}{lat['ping_p50_ms']:>10.3f}{lat['ping_p99_ms']:>10.3f}")
    print(f"  Redis server time per lookup (Lua, all replicas): {lat['redis_server_us_per_lookup']:.1f} us")
    print(f"\nCluster hit rate ({args.sim_replicas} workers x {args.capacity} chunks, {args.tenants} tenants, "
          f"{args.requests} requests)")
    print(f"  {'router':<16}{'hit rate':>10}{'max share':>11}{'imbalance':>11}")
    for name in ("oracle", "prefix_aware", "round_robin", "pow2_choices"):
        r = hr[name]
        print(f"  {name:<16}{r['hit_rate']:>10.3f}{r['max_share']:>11.3f}{r['imbalance']:>11.2f}")
    print(f"  prefix-aware reaches {hr['prefix_aware']['of_oracle']:.1%} of the oracle; "
          f"decisions: {hr['prefix_aware']['reasons']}")
    with open(args.json, "w") as f:
        json.dump({"latency": lat, "hit_rate": hr, "args": vars(args)}, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
