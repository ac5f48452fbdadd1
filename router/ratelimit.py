"""Per-tenant admission: token buckets for requests/s and tokens/min, and a concurrency counter.

Everything here is synchronous and never awaits, so each check-and-take runs atomically on the event loop
(no locks, no blocking calls). One ``RateLimiter`` belongs to one ingress replica: with several replicas,
each enforces the limits for the traffic it sees; ``ratelimit_redis.ClusterRateLimiter`` shares them
through Redis. Both offer the async ``admit`` / ``charge`` / ``finish`` that the ingress calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from chunkserve.router.tenants import RateLimitConfig, Tenant

Clock = Callable[[], float]


class Admission(Protocol):
    """Per-tenant admission: `RateLimiter` (this replica) or `ClusterRateLimiter` (shared through Redis)."""

    async def admit(self, tenant_id: str) -> AdmissionLease: ...

    def running(self, tenant_id: str) -> int: ...


class AdmissionLease(Protocol):
    """One admitted request: charge its token estimate, finish it with the tokens it really used."""

    async def charge(self, estimate: int) -> None: ...

    async def finish(self, actual_tokens: int | None = None) -> None: ...


class RateLimited(Exception):
    """The tenant is over a limit (HTTP 429 / gRPC RESOURCE_EXHAUSTED); retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: float, kind: str = "requests") -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = max(0.0, retry_after)
        self.kind = kind  # "requests" (requests/s), "concurrency" or "tokens" (tokens/min)

    @property
    def retry_after_header(self) -> str:
        """Whole seconds for the Retry-After header (at least 1)."""
        return str(max(1, math.ceil(self.retry_after)))


class RefusalMemo:
    """One ingress replica's memory of the tenants it just refused, so that their next requests are refused
    before their bodies are read and parsed (a flood of large bodies from a tenant over its limits held the
    event loop that every tenant shares). Over requests/s: until the bucket holds a request again, which no
    replica can make sooner. Over concurrency: until one of its requests here ends, or ``max_hold_s``."""

    def __init__(self, max_hold_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_hold_s = max_hold_s
        self.clock = clock
        self._until: dict[str, tuple[float, RateLimited]] = {}

    def note(self, tenant_id: str, e: RateLimited) -> None:
        if e.kind in ("requests", "concurrency"):  # tokens/min depends on the request's size: not remembered
            hold = e.retry_after if e.kind == "requests" else min(e.retry_after, self.max_hold_s)
            self._until[tenant_id] = (self.clock() + hold, e)

    def check(self, tenant_id: str) -> None:
        """Raises the remembered refusal (its wait shortened by the time passed) while it holds."""
        held = self._until.get(tenant_id)
        if held is not None:
            left = held[0] - self.clock()
            if left > 0:
                raise RateLimited(held[1].message, left, held[1].kind)
            del self._until[tenant_id]

    def released(self, tenant_id: str) -> None:
        """One of the tenant's requests ended here: a concurrency refusal no longer holds."""
        held = self._until.get(tenant_id)
        if held is not None and held[1].kind == "concurrency":
            del self._until[tenant_id]

    def watch(self, tenant_id: str, lease: AdmissionLease) -> AdmissionLease:
        """``lease``, whose finish also counts as a release here: however its request ends (served, a bad body,
        a failed check), a concurrency refusal of its tenant stops holding once its slot is free."""
        return _WatchedLease(lease, self, tenant_id)


class _WatchedLease:
    def __init__(self, inner: AdmissionLease, memo: RefusalMemo, tenant_id: str) -> None:
        self.inner, self.memo, self.tenant_id = inner, memo, tenant_id

    async def charge(self, estimate: int) -> None:
        await self.inner.charge(estimate)

    async def finish(self, actual_tokens: int | None = None) -> None:
        try:
            await self.inner.finish(actual_tokens)
        finally:
            self.memo.released(self.tenant_id)


def request_burst(rl: RateLimitConfig) -> int:
    """Requests a tenant may send at once: its ``burst_requests``, else one second's worth (at least 1)."""
    return rl.burst_requests or max(1, math.ceil(rl.requests_per_second or 1))


class TokenBucket:
    """A bucket of ``capacity`` tokens refilled at ``rate`` tokens/s. Taking may drive it negative (debt)."""

    def __init__(self, rate: float, capacity: float, clock: Clock = time.monotonic) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError(f"rate and capacity must be > 0, got {rate}, {capacity}")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self._clock = clock
        self._level = float(capacity)
        self._t = clock()

    def level(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + max(0.0, now - self._t) * self.rate)  # never drains
        self._t = now
        return self._level

    def wait_time(self, amount: float) -> float:
        """Seconds until ``amount`` (capped at the capacity, so any request can pass some day) is there."""
        need = min(float(amount), self.capacity)
        return max(0.0, (need - self.level()) / self.rate)

    def take(self, amount: float) -> None:
        self._level = self.level() - float(amount)

    def give_back(self, amount: float) -> None:
        self._level = min(self.capacity, self.level() + float(amount))


@dataclass
class _TenantState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    max_concurrent: int | None
    running: int = 0


@dataclass
class Lease:
    """One admitted request. ``charge_tokens`` after tokenising, ``release`` when the request ends."""

    limiter: RateLimiter
    tenant_id: str
    charged_tokens: int = 0
    released: bool = field(default=False)

    def charge_tokens(self, estimate: int) -> None:
        """Charge the tokens/min bucket with ``estimate`` (prompt + max new tokens); raises RateLimited
        (and releases the lease) when the bucket cannot cover it now."""
        self.limiter._charge(self, estimate)

    def release(self, actual_tokens: int | None = None) -> None:
        """Frees the concurrency slot and refunds charged tokens beyond ``actual_tokens``. Idempotent."""
        self.limiter._release(self, actual_tokens)

    async def charge(self, estimate: int) -> None:
        """The async form the ingress calls (shared with `ClusterLease`)."""
        self.charge_tokens(estimate)

    async def finish(self, actual_tokens: int | None = None) -> None:
        self.release(actual_tokens)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RateLimiter:
    """Admission for all tenants of one registry."""

    def __init__(self, tenants: Mapping[str, Tenant], clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, _TenantState] = {}
        for t in tenants.values():
            rl = t.rate_limit
            req = None
            if rl.requests_per_second is not None:
                req = TokenBucket(rl.requests_per_second, request_burst(rl), clock)
            tok = None
            if rl.tokens_per_minute is not None:
                tok = TokenBucket(rl.tokens_per_minute / 60.0, rl.tokens_per_minute, clock)
            self._state[t.id] = _TenantState(req, tok, t.max_concurrent_requests)

    def running(self, tenant_id: str) -> int:
        return self._state[tenant_id].running

    def acquire(self, tenant_id: str) -> Lease:
        """Admits one request of ``tenant_id`` against its concurrency and requests/s limits."""
        st = self._state.get(tenant_id)
        if st is None:
            raise KeyError(f"unknown tenant {tenant_id!r}")
        if st.max_concurrent is not None and st.running >= st.max_concurrent:
            raise RateLimited(f"tenant {tenant_id!r} has {st.running} requests running, "
                              f"its limit is {st.max_concurrent} concurrent requests", retry_after=1.0,
                              kind="concurrency")
        if st.requests is not None:
            wait = st.requests.wait_time(1)
            if wait > 0:
                raise RateLimited(f"tenant {tenant_id!r} is over its limit of "
                                  f"{st.requests.rate:g} requests/s", retry_after=wait, kind="requests")
            st.requests.take(1)
        st.running += 1
        return Lease(self, tenant_id)

    async def admit(self, tenant_id: str) -> Lease:
        """The async form the ingress calls (shared with `ClusterRateLimiter`)."""
        return self.acquire(tenant_id)

    def _charge(self, lease: Lease, estimate: int) -> None:
        if lease.released:
            raise RuntimeError("lease already released")
        st = self._state[lease.tenant_id]
        if st.tokens is None or estimate <= 0:
            return
        wait = st.tokens.wait_time(estimate)
        if wait > 0:
            self._release(lease, None)
            raise RateLimited(f"tenant {lease.tenant_id!r} is over its limit of "
                              f"{st.tokens.rate * 60:g} tokens/min", retry_after=wait, kind="tokens")
        st.tokens.take(estimate)
        lease.charged_tokens += estimate

    def _release(self, lease: Lease, actual_tokens: int | None) -> None:
        if lease.released:
            return
        lease.released = True
        st = self._state[lease.tenant_id]
        st.running -= 1
        if st.tokens is not None and actual_tokens is not None and lease.charged_tokens > actual_tokens:
            st.tokens.give_back(lease.charged_tokens - actual_tokens)
