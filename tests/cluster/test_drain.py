"""The cluster's drain flag in a real Redis: set by the launcher, read by every ingress, which then refuses new
requests with 503 + Retry-After (JSON through the API layer) while nothing else about it changes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis

from chunkserve.cluster.drain import DrainFlag, clear_draining, drain_key, mark_draining
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.router.ingress import Ingress, IngressConfig
from chunkserve.router.openai_api import APIError, CompletionRequest
from chunkserve.router.tenants import TenantRegistry


def test_flag_is_read_at_most_once_per_interval_and_then_stays_set(redis_server: RedisServer, namespace: str) -> None:
    async def run() -> list[bool]:
        flag = DrainFlag(redis_server.url, namespace, interval_s=0.3)
        seen = [await flag.is_set()]  # read: not set
        assert mark_draining(redis_server.url, namespace, ttl_s=30)
        seen.append(await flag.is_set())  # within the interval: the cached answer
        await asyncio.sleep(0.35)
        seen.append(await flag.is_set())  # read again: set
        clear_draining(redis_server.url, namespace)
        await asyncio.sleep(0.35)
        seen.append(await flag.is_set())  # a drain is never undone for a running ingress
        return seen

    assert asyncio.run(run()) == [False, False, True, True]


def test_flag_expires_with_its_ttl_and_clear_removes_it(redis_server: RedisServer, namespace: str) -> None:
    client = redis.Redis.from_url(redis_server.url)
    assert mark_draining(redis_server.url, namespace, ttl_s=0.2)
    assert client.get(drain_key(namespace)) == b"1"
    time.sleep(0.35)
    assert client.get(drain_key(namespace)) is None
    mark_draining(redis_server.url, namespace, ttl_s=30)
    clear_draining(redis_server.url, namespace)
    assert client.get(drain_key(namespace)) is None


def test_unreachable_redis_leaves_the_flag_unset_and_the_setter_reports_it() -> None:
    from chunkserve.cluster.redis_server import find_free_port

    url = f"redis://127.0.0.1:{find_free_port()}/0"  # nothing listens there
    assert mark_draining(url) is False
    assert asyncio.run(DrainFlag(url).is_set()) is False


class _NoEngine:
    """Any call means the ingress let a request through."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine was called ({name}) during a drain")


def test_ingress_refuses_new_requests_with_503_and_retry_after_once_the_flag_is_set(
        redis_server: RedisServer, namespace: str) -> None:
    ingress = Ingress(_NoEngine(), tokenizer=[0] * 300, tenants=TenantRegistry(None),  # type: ignore[arg-type]
                      config=IngressConfig(model_name="m", max_model_len=256, chunk_size=16, retry_after_s=3))
    ingress.drain_flag = DrainFlag(redis_server.url, namespace, interval_s=0.0)
    tenant = ingress.authenticate(None)
    req = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=4)

    async def run() -> APIError:
        prep = await ingress.prepare(tenant, req, "r0")  # no flag: admitted
        assert prep.request.prompt_token_ids == (1, 2, 3)
        await prep.lease.finish()
        mark_draining(redis_server.url, namespace)
        with pytest.raises(APIError) as err:
            await ingress.prepare(tenant, req, "r1")
        return err.value

    err = asyncio.run(run())
    assert err.status == 503 and err.headers == {"Retry-After": "3"}
    assert "shutting down" in err.message
