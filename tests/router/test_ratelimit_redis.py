"""Tenant limits shared by ingress replicas through a real Redis (`ClusterRateLimiter`)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from chunkserve.router.openai_api import APIError, CompletionRequest
from chunkserve.router.ratelimit import RateLimited
from chunkserve.router.ratelimit_redis import ClusterRateLimiter
from chunkserve.router.tenants import TenantRegistry, hash_api_key, parse_tenants


def _tenants(**over) -> TenantRegistry:
    return TenantRegistry(parse_tenants({"tenants": [
        {"id": "a", "api_key_sha256": [hash_api_key("key-a")], **over},
        {"id": "free", "api_key_sha256": [hash_api_key("key-free")]},
    ]}))


def _replicas(redis_server, namespace, n: int = 2, **over) -> list[ClusterRateLimiter]:
    reg = _tenants(**over)
    return [ClusterRateLimiter(reg.tenants, redis_server.url, namespace) for _ in range(n)]


def test_requests_per_second_burst_is_shared_by_two_replicas(redis_server, namespace) -> None:
    async def run() -> None:
        r1, r2 = _replicas(redis_server, namespace, rate_limit={"requests_per_second": 0.5, "burst_requests": 3})
        for lim in (r1, r2, r1):
            await (await lim.admit("a")).finish()
        with pytest.raises(RateLimited, match="requests/s") as ei:
            await r2.admit("a")  # each replica alone would still have 2 of its own 3
        assert 1.5 < ei.value.retry_after <= 2.0  # one request at 0.5 requests/s
        await (await r2.admit("free")).finish()  # other tenants are not limited
        for lim in (r1, r2):
            await lim.close()

    asyncio.run(run())


def test_concurrency_cap_counts_requests_running_on_every_replica(redis_server, namespace) -> None:
    async def run() -> None:
        r1, r2 = _replicas(redis_server, namespace, max_concurrent_requests=2)
        a, b = await r1.admit("a"), await r2.admit("a")
        with pytest.raises(RateLimited, match="across the cluster"):
            await r1.admit("a")
        assert r1.running("a") == 1 and r2.running("a") == 1
        await b.finish()
        await b.finish()  # idempotent: frees one slot only
        c = await r1.admit("a")
        with pytest.raises(RateLimited):
            await r2.admit("a")
        await a.finish()
        await c.finish()
        assert r1.running("a") == 0
        for lim in (r1, r2):
            await lim.close()

    asyncio.run(run())


def test_tokens_per_minute_are_charged_and_refunded_cluster_wide(redis_server, namespace) -> None:
    async def run() -> None:
        r1, r2 = _replicas(redis_server, namespace, rate_limit={"tokens_per_minute": 600})  # 10 tokens/s
        big = await r1.admit("a")
        await big.charge(500)
        small = await r2.admit("a")
        with pytest.raises(RateLimited, match="tokens/min") as ei:
            await small.charge(200)  # 100 left (+ a little refill): short by about 100 tokens
        assert 9.0 < ei.value.retry_after <= 10.0
        assert small.released and r2.running("a") == 0  # the failed charge released its own lease
        await big.finish(actual_tokens=100)  # refunds 400
        again = await r2.admit("a")
        await again.charge(200)
        await again.finish(200)
        for lim in (r1, r2):
            await lim.close()

    asyncio.run(run())


def test_a_lost_release_frees_its_slot_when_the_lease_expires(redis_server, namespace) -> None:
    async def run() -> None:
        reg = _tenants(max_concurrent_requests=1)
        dead = ClusterRateLimiter(reg.tenants, redis_server.url, namespace, lease_ttl_s=1.0)
        alive = ClusterRateLimiter(reg.tenants, redis_server.url, namespace, lease_ttl_s=1.0)
        await dead.admit("a")  # its replica dies: never finished
        with pytest.raises(RateLimited):
            await alive.admit("a")
        await asyncio.sleep(1.1)
        await (await alive.admit("a")).finish()
        for lim in (dead, alive):
            await lim.close()

    asyncio.run(run())


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_unreachable_redis_falls_back_to_this_replicas_limits(caplog, scheme: str) -> None:
    # a Redis Cluster with no node up raises RedisClusterException, which is not a RedisError: it must not escape
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there

    async def run() -> None:
        url = f"{scheme}://127.0.0.1:{port}" + ("/0" if scheme == "redis" else "")
        lim = ClusterRateLimiter(_tenants(max_concurrent_requests=1).tenants, url, timeout_s=0.2)
        lease = await lim.admit("a")
        assert lease.local is not None and lim.running("a") == 1
        with pytest.raises(RateLimited, match="concurrent"):
            await lim.admit("a")
        await lease.finish()
        assert lim.running("a") == 0
        await lim.close()

    asyncio.run(run())
    assert "Redis unreachable" in caplog.text


def test_two_ingress_replicas_answer_429_once_the_shared_burst_is_spent(redis_server, namespace) -> None:
    from chunkserve.router.ingress import Ingress, IngressConfig
    from chunkserve.workers.weights import load_model

    tokenizer = load_model("random:tiny").tokenizer
    reg = _tenants(rate_limit={"requests_per_second": 0.1, "burst_requests": 2})
    cfg = IngressConfig(model_name="m", max_model_len=256, chunk_size=16)

    async def run() -> None:
        replicas = [Ingress(None, tokenizer, reg, cfg,  # type: ignore[arg-type]  (prepare never calls the engine)
                            limiter=ClusterRateLimiter(reg.tenants, redis_server.url, namespace)) for _ in range(2)]
        tenant = reg.tenants["a"]
        req = CompletionRequest(model="m", prompt="hello there", max_tokens=2)
        for ing in replicas:
            prep = await ing.prepare(tenant, req, "r")
            await prep.lease.finish(3)
        with pytest.raises(APIError) as ei:
            await replicas[0].prepare(tenant, req, "r")
        assert ei.value.status == 429 and int(ei.value.headers["Retry-After"]) >= 9

    asyncio.run(run())


def test_a_slot_taken_by_an_admission_whose_answer_was_lost_is_removed_in_the_background(
        redis_server, namespace) -> None:
    async def run() -> None:
        reg = _tenants(max_concurrent_requests=1)
        slow = ClusterRateLimiter(reg.tenants, redis_server.url, namespace)  # 600 s leases
        other = ClusterRateLimiter(reg.tenants, redis_server.url, namespace)
        real_eval = slow._eval

        async def answer_lost(script, keys, *args):  # the script runs on the server, its answer times out
            await real_eval(script, keys, *args)
            raise TimeoutError

        slow._eval = answer_lost  # type: ignore[method-assign]
        lease = await slow.admit("a")  # served on the local fallback
        assert lease.local is not None
        await asyncio.gather(*slow._cleanups)
        await (await other.admit("a")).finish()  # the slot left on the server is gone, not held for 10 minutes
        await lease.finish()
        for lim in (slow, other):
            await lim.close()

    asyncio.run(run())
