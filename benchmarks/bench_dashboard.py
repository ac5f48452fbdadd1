"""How fast ``/dashboard/api/state`` answers with 8 workers and 10,000 cached chunks (target: < 50 ms).

Builds 8 real prefix trees (``PrefixKVCache`` with a tiny head, so no model is needed) holding 10,000
chunks in all (shared group prompts, private prompts and per-request tails, usage recorded as the engine
records it), writes each worker's forest summary and stats snapshot to a real ``redis-server`` exactly as a
worker does, and times the endpoint over HTTP (uvicorn on loopback) with the stats reader's cache off, so
every request reads Redis. Also prints what one summary costs on a worker's engine thread.

    python benchmarks/bench_dashboard.py [--workers 8] [--chunks 10000] [--requests 50]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request

import redis
import torch
import uvicorn

from chunkserve.cluster.index import IndexKeys
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.cluster.stats import ClusterStatsReader, WorkerStatsWriter
from chunkserve.router.http_app import create_app
from chunkserve.router.ingress import Ingress, IngressConfig
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.tree_summary import ForestUsage, summarize_forest
from chunkserve.workers.worker_metrics import RoutingAccuracy

CHUNK = 16
NS = "benchdash"


def build_tree(chunks: int, seed: int, tenants: list[str]) -> tuple[PrefixKVCache, ForestUsage]:
    """A tree with about ``chunks`` cached chunks: group prompts of 16-64 chunks with many short tails."""
    rng = random.Random(seed)
    cache = PrefixKVCache(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=CHUNK, num_chunks=chunks + 64)
    usage = ForestUsage()
    prompts = [[rng.randrange(1000, 30_000) for _ in range(CHUNK * rng.randrange(16, 64))] for _ in range(12)]
    while cache.stats()["kv_chunks_cached"] < chunks - 8:
        base = rng.choice(prompts)
        tenant = rng.choice(tenants)
        salt = b"grp" if tenant in ("acme", "globex") else tenant.encode()
        toks = base + [rng.randrange(30_000, 40_000) for _ in range(CHUNK * rng.randrange(1, 4))]
        cached = cache.match(toks, salt)
        kv = torch.zeros(1, len(toks), 1, 2)  # [L, n, Hkv, D]
        s = cache.add_sequence(toks, kv, kv, salt=salt)
        usage.record(cache, toks, salt, cached, tenant)
        cache.remove_sequence(s)
    return cache, usage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=10_000, help="cached chunks over all workers")
    ap.add_argument("--requests", type=int, default=50)
    args = ap.parse_args()
    tenant_ids = ["acme", "globex", "initech", "umbrella"]
    registry = TenantRegistry(parse_tenants({
        "tenants": [{"id": t, "api_key_sha256": [hash_api_key(f"sk-{t}")],
                     "cache_scope": "shared:grp" if t in ("acme", "globex") else "private"} for t in tenant_ids],
        "admin_api_key_sha256": [hash_api_key("sk-admin")]}))
    per = args.chunks // args.workers
    with RedisServer() as srv:
        client = redis.Redis.from_url(srv.url)
        total_nodes, summary_ms, sizes = 0, [], []
        for w in range(args.workers):
            wid = f"worker{w}"
            cache, usage = build_tree(per, w, tenant_ids)
            t0 = time.perf_counter()
            summary = summarize_forest(cache, usage)
            summary_ms.append(1000 * (time.perf_counter() - t0))
            total_nodes += summary["num_nodes"]
            sizes.append(len(json.dumps(summary)))
            acc = RoutingAccuracy(wid, CHUNK)
            for i in range(200):
                acc.record(str(i), {"reason": "prefix_hit", "depth": 8, "expected": {wid: 8}}, 128 - 16 * (i % 7 == 0))
            writer = WorkerStatsWriter(client, wid, namespace=NS, ttl_s=600)
            writer.write({**cache.stats(), "prompt_tokens_total": 10_000, "prefix_cached_tokens": 7_000,
                          "routing": acc.snapshot(), "kv_cache_usage_perc": 0.1})
            writer.write_forest(summary)
            client.zadd(IndexKeys(NS).registry, {wid: time.time() * 1000})
        big, big_usage = build_tree(args.chunks, 99, tenant_ids)
        t0 = time.perf_counter()
        summarize_forest(big, big_usage)
        big_ms = 1000 * (time.perf_counter() - t0)

        reader = ClusterStatsReader(srv.url, NS, cache_ttl_s=0.0)
        ingress = Ingress(engine=object(), tokenizer=None, tenants=registry,
                          config=IngressConfig(model_name="bench", max_model_len=512, chunk_size=CHUNK,
                                               vocab_size=100), cluster_stats=reader)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(ingress), host="127.0.0.1", port=port, log_level="warning"))
        th = threading.Thread(target=server.run, daemon=True)
        th.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/dashboard/api/state"
        req = urllib.request.Request(url, headers={"Authorization": "Bearer sk-admin"})
        lat, body = [], b""
        for _ in range(args.requests + 5):
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=10) as r:
                body = r.read()
            lat.append(1000 * (time.perf_counter() - t0))
        lat = sorted(lat[5:])  # the first few warm up the connection pool
        t0 = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url.replace("/api/state", ""))) as r:
            r.read()
        page_ms = 1000 * (time.perf_counter() - t0)
        server.should_exit = True
        th.join(timeout=5)
        state = json.loads(body)
    print(f"workers {args.workers}, cached chunks {total_nodes}, summary JSON {sum(sizes) / 1024:.0f} KiB in all, "
          f"response {len(body) / 1024:.0f} KiB, runs shown {sum(w['forest']['runs_shown'] for w in state['workers'])}")
    print(f"summary on the engine thread: {statistics.median(summary_ms):.1f} ms per worker ({per} chunks), "
          f"{big_ms:.1f} ms for one tree of {args.chunks} chunks")
    print(f"/dashboard/api/state over {len(lat)} requests: p50 {lat[len(lat) // 2]:.1f} ms, "
          f"p95 {lat[int(0.95 * (len(lat) - 1))]:.1f} ms, max {lat[-1]:.1f} ms (target < 50 ms)")
    print(f"/dashboard page: {page_ms:.1f} ms")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
