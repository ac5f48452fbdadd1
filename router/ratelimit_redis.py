"""Cluster-wide tenant limits in Redis: every ingress replica takes from the same buckets.

The local `RateLimiter` enforces each limit per ingress replica, so N replicas would let a tenant through
N times over. `ClusterRateLimiter` keeps the same token buckets (requests/s, tokens/min) and concurrency
caps in Redis instead, with the same semantics: one Lua call per check, atomic on the server and timed by
Redis's own clock (replicas need no clock sync). Tenants with no limit never touch Redis.

Keys (one hash tag per tenant, so a Redis Cluster keeps them in one slot)::

    {<ns>:rl:<tenant>}:b    hash  rl, rt (requests bucket level, last refill ms), tl, tt (tokens bucket)
    {<ns>:rl:<tenant>}:run  zset  lease id -> expiry (ms); expired entries (a replica that died) are dropped

A concurrency lease expires after ``lease_ttl_s`` even if its release is lost (a replica that died); a replica
that lost Redis's answer to an admission (which may have taken a slot) or to a release removes that slot in the
background, retried, so a slow Redis does not lock a tenant out until the lease expires. When Redis cannot be
reached the replica falls back to its local limiter (per-replica limits, logged once) rather than
refusing traffic, and goes back to Redis when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chunkserve.cluster.index import REDIS_ERRORS, AsyncRedis, async_redis_client
from chunkserve.router.ratelimit import Lease, RateLimited, RateLimiter, request_burst
from chunkserve.router.tenants import Tenant

logger = logging.getLogger(__name__)
FORGET_RETRY_S = (0.5, 2.0, 8.0, 30.0)  # waits between tries to remove a slot a lost answer may have left

# Shared by both scripts: Redis's clock in ms, and a bucket (level field lf, refill-time field tf in hash
# KEYS[1]) refilled up to now; store() writes it back with a TTL past the time it would be full again.
_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function refilled(lf, tf, rate, cap)
  local lvl, ts = tonumber(redis.call('HGET', KEYS[1], lf)), tonumber(redis.call('HGET', KEYS[1], tf))
  if lvl == nil then return cap end
  return math.min(cap, lvl + math.max(0, now - ts) / 1000 * rate)  -- a clock stepped back refills nothing
end
local function store(lf, tf, lvl, rate, cap)
  redis.call('HSET', KEYS[1], lf, tostring(lvl), tf, now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(cap / rate * 1000) + 3600000)
end
"""

# KEYS: bucket hash, run zset. ARGV: req rate/s, req capacity, max concurrent (-1: none), lease id, lease ms.
# -> {1, 0} admitted; {0, wait_ms, 1} too many running; {0, wait_ms, 2} over requests/s.
_ACQUIRE = _BUCKET + """
local rate, cap, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if maxc >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= maxc then return {0, 1000, 1} end
end
if rate > 0 then
  local lvl = refilled('rl', 'rt', rate, cap)
  if lvl < 1 then
    store('rl', 'rt', lvl, rate, cap)
    return {0, math.ceil((1 - lvl) / rate * 1000), 2}
  end
  store('rl', 'rt', lvl - 1, rate, cap)
end
if maxc >= 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[4])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[5]))
end
return {1, 0, 0}
"""

# KEYS: bucket hash. ARGV: tokens rate/s, capacity, amount (>0 take, <0 give back). -> wait ms (0: done).
_TOKENS = _BUCKET + """
local rate, cap, amount = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lvl = refilled('tl', 'tt', rate, cap)
local need = math.min(amount, cap)
if amount > 0 and lvl < need then
  store('tl', 'tt', lvl, rate, cap)
  return math.ceil((need - lvl) / rate * 1000)
end
store('tl', 'tt', math.min(cap, lvl - amount), rate, cap)
return 0
"""


@dataclass(frozen=True)
class _Limits:
    req_rate: float | None
    req_cap: float
    tok_rate: float | None  # tokens per second
    tok_cap: float
    max_concurrent: int | None



@dataclass
class ClusterLease:
    """An admitted request: ``await charge(estimate)`` after tokenising, ``await finish(actual)`` at the end."""

    limiter: ClusterRateLimiter
    tenant_id: str
    lease_id: str
    local: Lease | None = None  # set when Redis was unreachable at admission: the local limiter's lease
    charged_tokens: int = 0
    released: bool = field(default=False)

    async def charge(self, estimate: int) -> None:
        await self.limiter._charge(self, estimate)

    async def finish(self, actual_tokens: int | None = None) -> None:
        await self.limiter._release(self, actual_tokens)


class ClusterRateLimiter:
    """Admission against limits shared by every ingress replica (see the module docstring)."""

    def __init__(self, tenants: Mapping[str, Tenant], redis_url: str, namespace: str = "chunkserve",
                 lease_ttl_s: float = 600.0, timeout_s: float = 0.5) -> None:
        self._limits: dict[str, _Limits] = {}
        for t in tenants.values():
            rl = t.rate_limit
            tpm = rl.tokens_per_minute
            self._limits[t.id] = _Limits(
                rl.requests_per_second, float(request_burst(rl)),
                None if tpm is None else tpm / 60.0, float(tpm or 1), t.max_concurrent_requests)
        self.fallback = RateLimiter(tenants)
        self.namespace = namespace
        self.lease_ms = max(1000, int(lease_ttl_s * 1000))
        self._url, self._timeout = redis_url, timeout_s
        self._client: AsyncRedis | None = None  # created on first use, inside the serving event loop
        self._running: dict[str, int] = {tid: 0 for tid in self._limits}
        self._redis_ok = True
        self._cleanups: set[asyncio.Task] = set()  # background removals of slots a timeout may have left

    def _keys(self, tenant_id: str) -> tuple[str, str]:
        tag = f"{{{self.namespace}:rl:{tenant_id}}}"
        return f"{tag}:b", f"{tag}:run"

    def running(self, tenant_id: str) -> int:
        """Requests of ``tenant_id`` this replica has admitted and not yet finished."""
        return self._running[tenant_id] + self.fallback.running(tenant_id)

    def _redis(self) -> AsyncRedis:
        if self._client is None:
            self._client = async_redis_client(self._url, self._timeout)
        return self._client

    async def _eval(self, script: str, keys: tuple[str, ...], *args: Any) -> Any:
        res = await asyncio.wait_for(self._redis().eval(script, len(keys), *keys, *args), self._timeout * 2)
        if not self._redis_ok:
            logger.info("rate limits: Redis answers again; limits are cluster-wide")
            self._redis_ok = True
        return res

    def _redis_down(self, e: BaseException) -> None:
        if self._redis_ok:
            logger.warning("rate limits: Redis unreachable (%s); enforcing them per ingress replica", e)
        self._redis_ok = False

    async def admit(self, tenant_id: str) -> ClusterLease:
        """One request of ``tenant_id`` against its concurrency and requests/s limits; raises RateLimited."""
        lim = self._limits.get(tenant_id)
        if lim is None:
            raise KeyError(f"unknown tenant {tenant_id!r}")
        lease = ClusterLease(self, tenant_id, uuid.uuid4().hex)
        if lim.req_rate is not None or lim.max_concurrent is not None:
            try:
                ok, wait_ms, why = await self._eval(
                    _ACQUIRE, self._keys(tenant_id), lim.req_rate or 0, lim.req_cap,
                    -1 if lim.max_concurrent is None else lim.max_concurrent, lease.lease_id, self.lease_ms)
            except REDIS_ERRORS as e:
                self._redis_down(e)
                if lim.max_concurrent is not None:  # the script may have run before the answer was lost
                    self._forget(tenant_id, lease.lease_id)
                lease.local = self.fallback.acquire(tenant_id)
                return lease
            if not ok:
                if int(why) == 1:
                    raise RateLimited(f"tenant {tenant_id!r} has {lim.max_concurrent} requests running across "
                                      f"the cluster, its limit", retry_after=wait_ms / 1000, kind="concurrency")
                raise RateLimited(f"tenant {tenant_id!r} is over its limit of {lim.req_rate:g} requests/s",
                                  retry_after=wait_ms / 1000, kind="requests")
        self._running[tenant_id] += 1
        return lease

    async def _charge(self, lease: ClusterLease, estimate: int) -> None:
        if lease.released:
            raise RuntimeError("lease already released")
        if lease.local is not None:
            try:
                lease.local.charge_tokens(estimate)
            except RateLimited:
                lease.released = True
                raise
            return
        lim = self._limits[lease.tenant_id]
        if lim.tok_rate is None or estimate <= 0:
            return
        try:
            wait_ms = int(await self._eval(_TOKENS, self._keys(lease.tenant_id)[:1], lim.tok_rate, lim.tok_cap,
                                           estimate))
        except REDIS_ERRORS as e:
            self._redis_down(e)
            return  # admitted already; the token charge is skipped rather than failing the request
        if wait_ms > 0:
            await self._release(lease, None)
            raise RateLimited(f"tenant {lease.tenant_id!r} is over its limit of {lim.tok_rate * 60:g} tokens/min",
                              retry_after=wait_ms / 1000, kind="tokens")
        lease.charged_tokens += estimate

    async def _release(self, lease: ClusterLease, actual_tokens: int | None) -> None:
        if lease.released:
            return
        lease.released = True
        if lease.local is not None:
            lease.local.release(actual_tokens)
            return
        self._running[lease.tenant_id] -= 1
        lim = self._limits[lease.tenant_id]
        bucket, run = self._keys(lease.tenant_id)
        try:
            if lim.max_concurrent is not None:
                await asyncio.wait_for(self._redis().zrem(run, lease.lease_id), self._timeout * 2)
            refund = lease.charged_tokens - actual_tokens if actual_tokens is not None else 0
            if lim.tok_rate is not None and refund > 0:
                await self._eval(_TOKENS, (bucket,), lim.tok_rate, lim.tok_cap, -refund)
        except REDIS_ERRORS as e:
            self._redis_down(e)
            if lim.max_concurrent is not None:
                self._forget(lease.tenant_id, lease.lease_id)

    def _forget(self, tenant_id: str, lease_id: str) -> None:
        """Removes ``lease_id``'s concurrency slot in the background, retried while Redis does not answer: a
        slot left behind by a lost answer would count against the tenant until the lease expires (10 minutes
        by default). The lease id is unique, so a removal that already happened is harmless."""
        task = asyncio.get_running_loop().create_task(self._remove_slot(tenant_id, lease_id))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _remove_slot(self, tenant_id: str, lease_id: str) -> None:
        run = self._keys(tenant_id)[1]
        for delay in FORGET_RETRY_S:
            try:
                await asyncio.wait_for(self._redis().zrem(run, lease_id), self._timeout * 2)
                return
            except REDIS_ERRORS:
                await asyncio.sleep(delay)

    async def close(self) -> None:
        for task in list(self._cleanups):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
