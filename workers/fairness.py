"""Fair share across tenants: the virtual token counter (VTC) of Sheng et al., OSDI 2024.

Each tenant has a counter of the service it received, in weighted tokens:
``counter += (prefill_cost * prefill_tokens + decode_cost * decode_tokens) / weight``. Admission and
prefill order (`choose`): among the requests with prompt work left of the tenants whose counter is within
``quantum`` of the smallest such counter, the one with the least prompt left to compute goes first
(shortest remaining work, so the chats that follow a just-computed system prompt are not made to wait
behind another whole prompt); each tenant puts forward one request (the scheduler's choice: its oldest, or
a cheap one within an aging bound); ``quantum=0`` is strict VTC order. A
tenant that arrives after being idle is lifted to the smallest counter among the tenants with work,
so idle time banks no credit, and a tenant with nothing queued takes no share: the scheduler stays
work-conserving. With ``enabled=False`` the order is first come, first served (arrival order); the
counters and the served-token figures are kept either way, for the metrics.

``share(tenant)`` is ``chunkserve:tenant_share``: the tenant's fraction of the recent weighted service
(decayed with a time constant of ``window_s``) over its fair fraction among the tenants served in
that window (its weight over their weights). 1.0 is exactly fair; below 1 it got less than its share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar


class HasTenant(Protocol):
    tenant: str
    weight: float
    seq: tuple[float, int]  # queue order: (arrival, add order)


R = TypeVar("R", bound=HasTenant)


@dataclass(frozen=True)
class FairnessConfig:
    """VTC settings (from `SchedulerConfig`: ``fair_share`` and ``fair_quantum``, set in `EngineConfig`)."""

    enabled: bool = True
    prefill_cost: float = 1.0  # weight of a prefill token in the counter
    decode_cost: float = 2.0  # weight of a decode token (the paper's w_q = 1, w_p = 2)
    window_s: float = 60.0  # decay time constant of tenant_share
    quantum: float = 2048.0  # how far (weighted tokens) a tenant's counter may lead while its shorter work goes first

    def __post_init__(self) -> None:
        if self.prefill_cost < 0 or self.decode_cost < 0 or self.prefill_cost + self.decode_cost <= 0:
            raise ValueError("prefill_cost and decode_cost must be >= 0 and not both 0")
        if not (self.quantum >= 0 and math.isfinite(self.quantum)):
            raise ValueError(f"quantum must be a finite number >= 0, got {self.quantum!r}")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")


@dataclass
class TenantServed:
    """One tenant's counter and served figures (cumulative unless said otherwise)."""

    counter: float = 0.0
    weight: float = 1.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    queue_time_s: float = 0.0  # summed arrival -> first admission
    admitted: int = 0
    recent: float = 0.0  # decayed weighted service (cost, not divided by the weight)
    recent_at: float = field(default_factory=time.monotonic)


class FairShare:
    """The counters and the pick; the scheduler calls ``arrive``, ``charge`` and ``pick``."""

    def __init__(self, config: FairnessConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or FairnessConfig()
        self.clock = clock
        self.tenants: dict[str, TenantServed] = {}

    def _get(self, tenant: str, weight: float = 1.0) -> TenantServed:
        t = self.tenants.get(tenant)
        if t is None:
            t = self.tenants[tenant] = TenantServed(weight=weight, recent_at=self.clock())
        return t

    def arrive(self, tenant: str, weight: float, busy_tenants: Iterable[str]) -> None:
        """A request of ``tenant`` joins; ``busy_tenants``: tenants with queued or running requests before it."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"tenant weight must be a positive number, got {weight!r}")
        busy = set(busy_tenants)
        t = self._get(tenant, weight)
        t.weight = weight
        if tenant not in busy:  # back from idle: lift to the lowest counter among the busy tenants
            floor = [self.tenants[b].counter for b in busy if b in self.tenants]
            if floor:
                t.counter = max(t.counter, min(floor))

    def charge(self, tenant: str, prefill: int = 0, decode: int = 0) -> None:
        cfg = self.config
        t = self._get(tenant)
        cost = cfg.prefill_cost * prefill + cfg.decode_cost * decode
        t.counter += cost / t.weight
        t.prefill_tokens += prefill
        t.decode_tokens += decode
        now = self.clock()
        t.recent = t.recent * math.exp(-(now - t.recent_at) / cfg.window_s) + cost
        t.recent_at = now

    def admitted(self, tenant: str, waited_s: float) -> None:
        t = self._get(tenant)
        t.queue_time_s += max(0.0, waited_s)
        t.admitted += 1

    def key(self, req: HasTenant) -> tuple[float, float, tuple[float, int]]:
        """Priority of a request (smaller first): (tenant counter, recent service, arrival) with VTC, else
        (0, 0, arrival). Recent service (decayed over ``window_s``) breaks ties between tenants: a tenant back
        from idle is lifted to the busy tenants' lowest counter, and then goes before the one that was served
        all along. A tenant's requests share both, so they keep their arrival order."""
        if not self.config.enabled:
            return (0.0, 0.0, req.seq)
        t = self.tenants.get(req.tenant)
        if t is None:
            return (0.0, 0.0, req.seq)
        recent = t.recent * math.exp(-(self.clock() - t.recent_at) / self.config.window_s)
        return (t.counter, recent, req.seq)

    def pick(self, waiting: Sequence[HasTenant]) -> int:
        """Index of the request to admit next (the queue is kept in arrival order)."""
        if not self.config.enabled or len(waiting) < 2:
            return 0
        best, best_key = 0, self.key(waiting[0])
        seen = {waiting[0].tenant}
        for i, r in enumerate(waiting[1:], 1):
            if r.tenant in seen:  # only each tenant's oldest request competes
                continue
            seen.add(r.tenant)
            k = self.key(r)
            if k < best_key:
                best, best_key = i, k
        return best

    def choose(self, heads: Sequence[R], remaining: Callable[[R], int]) -> R:
        """The request whose prompt work goes next, among each tenant's candidate (``heads``: non-empty).

        First come, first served: the oldest. Fair share: only the tenants whose counter is at most ``quantum``
        above the smallest counter among ``heads`` qualify (the least served tenant always does, so no tenant
        falls more than ``quantum``, plus one step's pieces, behind another with work); among them the least
        ``remaining`` (prompt tokens still to compute) goes first, then `key`. ``remaining`` is asked only of
        the qualifying heads."""
        if not self.config.enabled:
            return min(heads, key=lambda r: r.seq)
        if len(heads) == 1:
            return heads[0]
        keys = [self.key(r) for r in heads]
        bound = min(k[0] for k in keys) + self.config.quantum

        def order(i: int) -> tuple[bool, int, tuple[float, float, tuple[float, int]]]:
            over = keys[i][0] > bound
            return over, 0 if over else remaining(heads[i]), keys[i]

        return heads[min(range(len(heads)), key=order)]

    def slot_victim(self, running: Sequence[HasTenant], waiting: Sequence[HasTenant],
                    slots: int) -> tuple[HasTenant, HasTenant] | None:
        """With every batch slot taken, ``(victim, waiter)``: the running request to preempt so that the waiting
        request of a tenant holding fewer than its fair share of the slots takes its slot; or None.

        A tenant's fair share of ``slots`` is its weight over the weights of the tenants with work (running
        or waiting), at least one slot. The waiter is the tenant ``pick`` would admit among those below their
        share, if its counter is not above the victim's tenant's (so weighted service holds); the victim is the
        newest request of the tenant furthest above its share. Preempted work keeps
        its cached chunks, so a victim's re-admission mostly reuses them. No churn: a tenant at its share is
        never a waiter, and one below it never a victim.
        """
        if not self.config.enabled or not waiting or len(running) < slots:
            return None
        count: dict[str, int] = {}
        weight: dict[str, float] = {}
        for r in (*running, *waiting):
            count.setdefault(r.tenant, 0)
            weight[r.tenant] = self.tenants[r.tenant].weight if r.tenant in self.tenants else r.weight
        for r in running:
            count[r.tenant] += 1
        wsum = sum(weight.values())
        fair = {t: max(1.0, slots * w / wsum) for t, w in weight.items()}
        starved = [r for r in waiting if count[r.tenant] + 1 <= fair[r.tenant]]
        if not starved:
            return None
        over = {t: count[t] - fair[t] for t in count if count[t] > fair[t]}
        if not over:
            return None
        worst = max(over, key=lambda t: (over[t], t))
        victim = max((r for r in running if r.tenant == worst), key=lambda r: r.seq)
        waiter = starved[self.pick(starved)]
        if self.key(waiter)[0] > self.key(victim)[0]:  # the waiter's tenant is ahead in service: weights hold
            return None
        return victim, waiter

    def share(self) -> dict[str, float]:
        """Each recently served tenant's share of the weighted service over its fair share (1.0 = fair)."""
        now = self.clock()
        recent = {name: t.recent * math.exp(-(now - t.recent_at) / self.config.window_s)
                  for name, t in self.tenants.items()}
        active = {n: r for n, r in recent.items() if r > 1e-6}
        total = sum(active.values())
        wsum = sum(self.tenants[n].weight for n in active)
        if not total or not wsum:
            return {}
        return {n: (r / total) / (self.tenants[n].weight / wsum) for n, r in active.items()}

    def stats(self) -> dict[str, dict[str, float]]:
        """Per tenant: served prefill/decode tokens, queueing time, counter and share (engine stats)."""
        share = self.share()
        return {name: {"prefill_tokens": t.prefill_tokens, "decode_tokens": t.decode_tokens,
                       "queue_time_s": t.queue_time_s, "admitted": t.admitted, "counter": t.counter,
                       "weight": t.weight, "share": share.get(name, 0.0)}
                for name, t in self.tenants.items()}
