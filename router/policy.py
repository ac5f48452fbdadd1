"""Prefix-aware routing policy: pure logic, no Ray, no Redis.

Inputs per decision: the candidate replicas with their load, the request's chunk hash chain, and the
per-replica longest cached prefix from the index (``None`` when the index could not answer). Rules:

1. ``no_chain``: the request has no full chunk -> least loaded replica (ties rotate).
2. ``prefix_hit``: among replicas holding >= ``min_match_chunks`` leading chunks (index, or a local hint
   that we sent this prefix there recently), take the best ``match - load_cost_chunks * load`` that is
   not overloaded.
3. ``spill``: every holder is overloaded -> the least loaded replica that is not; the local hint map
   records that the prefix now lives there too, so later requests of a hot prefix spread over both.
4. ``cold_hash``: nobody holds it -> rendezvous (highest-random-weight) hashing on the first chunk hash,
   skipping overloaded replicas, so one system prompt keeps landing on one replica. With ``cold_slack``
   set (off by default), only the replicas within that many requests of the least load take part, which
   spreads new prefixes arriving together by load (with 4 tenants' prompts on 2 replicas, rendezvous alone
   puts 3 or 4 on one replica half the time) but depends on the load each router sees, so two ingress
   replicas may place one new prefix apart. Measured: neither setting removed the occasional recomputed
   prompt on the 32-chat workload of ``benchmarks/compare_llama.sh``, and load-aware placement broke the
   rendezvous split a capacity-bound test relies on, so rendezvous stays the default. Behind Ray, the
   router then claims a cold prefix in Redis (`cluster/claims.py`): among `cold_candidates` (rendezvous
   order, overloaded ones left out) the worker with the least claimed cold work, and every router follows a
   live claim (`follow_claim`), so ingress replicas agree and new prefixes spread evenly. A claim's worker
   counts as a holder of the whole chain (it is computing it): requests follow it under the spill rule of
   rule 3 with ``m`` = the chain's chunks, not the cold rule (before, a tenant's burst of 8 requests, half of
   them routed by another ingress replica, left the claim after 4 and recomputed the prompt elsewhere).
5. ``redis_down``: the index is unreachable -> rules 2-4 on local hints only (rendezvous when none).
   (A lookup that is merely slower than the budget also uses hints only, under the usual reasons.)

A replica is overloaded when it is at capacity, or when its load exceeds the least loaded replica's by
at least ``spill_abs + spill_per_chunk * m`` *and* is at least ``spill_rel`` times ``(least load + 1)``,
``m`` being the chunks of the request it holds: a spill recomputes those chunks elsewhere (about a second
of CPU per 1,000 tokens on a small worker), so a long cached prefix stays put under a larger imbalance.
Measured on the 32-chat workload of ``benchmarks/compare_llama.sh`` (16-chunk prompts, 2 workers, 2 ingress
replicas): with ``spill_abs`` 4 alone a burst spilled 1-3 requests, each recomputing a 1,000-token prompt.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

REASONS = ("prefix_hit", "spill", "cold_hash", "redis_down", "no_chain")


@dataclass(frozen=True)
class PolicyConfig:
    """Routing knobs (see the module docstring)."""

    spill_abs: int = 4
    spill_rel: float = 2.0
    load_cost_chunks: float = 0.25
    min_match_chunks: int = 1
    hint_ttl_s: float = 30.0
    max_hints: int = 200_000
    cold_slack: int | None = None  # None: rendezvous regardless of load (below overload)
    spill_per_chunk: float = 0.5

    def __post_init__(self) -> None:
        if self.spill_abs < 1:
            raise ValueError(f"PolicyConfig.spill_abs must be >= 1, got {self.spill_abs}")
        if self.spill_rel < 1.0:
            raise ValueError(f"PolicyConfig.spill_rel must be >= 1.0, got {self.spill_rel}")
        if self.load_cost_chunks < 0:
            raise ValueError(f"PolicyConfig.load_cost_chunks must be >= 0, got {self.load_cost_chunks}")
        if self.min_match_chunks < 1:
            raise ValueError(f"PolicyConfig.min_match_chunks must be >= 1, got {self.min_match_chunks}")
        if self.hint_ttl_s < 0 or self.max_hints < 0 or (self.cold_slack or 0) < 0 or self.spill_per_chunk < 0:
            raise ValueError("PolicyConfig.hint_ttl_s, max_hints, cold_slack and spill_per_chunk must be >= 0")


@dataclass(frozen=True)
class ReplicaLoad:
    """A candidate replica: its worker id, ongoing requests and capacity (max ongoing; <= 0: unbounded)."""

    replica_id: str
    ongoing: int
    capacity: int = 0


@dataclass(frozen=True)
class Decision:
    """The chosen replica, why, how many chunks it holds, the full preference order, and how many leading
    chunks each candidate is expected to hold (index and hints; absent: none), the routing prediction."""

    replica_id: str
    reason: str
    matched_chunks: int
    ranking: tuple[str, ...] = field(default=())
    expected: Mapping[str, int] = field(default_factory=dict)


def rendezvous_weight(key: int, replica_id: str) -> int:
    """Highest-random-weight score of ``replica_id`` for ``key`` (stable across processes)."""
    h = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8, key=replica_id.encode()[:64])
    return int.from_bytes(h.digest(), "little")


class PrefixPolicy:
    """Stateful only in its hint map (prefix hash -> replicas recently sent that prefix) and RR counter."""

    def __init__(self, config: PolicyConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or PolicyConfig()
        self._clock = clock
        self._hints: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._rr = 0

    # -- hints -------------------------------------------------------------------------------------
    def record(self, chain: Sequence[int], replica_id: str) -> None:
        """Remember that ``replica_id`` now holds every prefix of ``chain`` (until ``hint_ttl_s``)."""
        if self.config.max_hints == 0 or self.config.hint_ttl_s == 0:
            return
        expiry = self._clock() + self.config.hint_ttl_s
        for h in chain:
            d = self._hints.get(h)
            if d is None:
                self._hints[h] = {replica_id: expiry}
            else:
                d[replica_id] = expiry
                self._hints.move_to_end(h)
        while len(self._hints) > self.config.max_hints:
            self._hints.popitem(last=False)

    def forget_replica(self, replica_id: str) -> None:
        """Drop a dead replica from every hint."""
        for h in list(self._hints):
            d = self._hints[h]
            d.pop(replica_id, None)
            if not d:
                del self._hints[h]

    def hinted_matches(self, chain: Sequence[int]) -> dict[str, int]:
        """Per replica, the longest prefix of ``chain`` the hint map says it holds."""
        now = self._clock()
        out: dict[str, int] = {}
        for i, h in enumerate(chain):
            d = self._hints.get(h)
            if d is None:
                break  # hints are recorded for whole prefixes: deeper ones cannot exist
            alive = False
            for r, exp in d.items():
                if exp > now:
                    out[r] = i + 1
                    alive = True
            if not alive:
                break
        return out

    # -- decisions ---------------------------------------------------------------------------------
    def _overloaded(self, r: ReplicaLoad, min_load: int, matched: int = 0) -> bool:
        if r.capacity > 0 and r.ongoing >= r.capacity:
            return True
        c = self.config
        return (r.ongoing - min_load >= c.spill_abs + c.spill_per_chunk * matched
                and r.ongoing >= c.spill_rel * (min_load + 1))

    def decide(self, replicas: Sequence[ReplicaLoad], chain: Sequence[int],
               matches: Mapping[str, int] | None) -> Decision:
        """Choose a replica. ``matches`` is None when the index did not answer (reason ``redis_down``)."""
        if not replicas:
            raise ValueError("decide() needs at least one candidate replica")
        min_load = min(r.ongoing for r in replicas)
        if not chain:
            return self._least_loaded(replicas, "no_chain", {})
        eff = self.hinted_matches(chain)
        if matches is not None:
            for rid, m in matches.items():
                if m > eff.get(rid, 0):
                    eff[rid] = m
        down = matches is None
        holders = [r for r in replicas if eff.get(r.replica_id, 0) >= self.config.min_match_chunks]
        if holders:
            cost = self.config.load_cost_chunks
            holders.sort(key=lambda r: (-(eff[r.replica_id] - cost * r.ongoing), r.ongoing, r.replica_id))
            fit = [r for r in holders if not self._overloaded(r, min_load, eff[r.replica_id])]
            if fit:
                return self._decision(fit[0], "redis_down" if down else "prefix_hit", eff, replicas)
            best = self._spill_target(replicas, min_load, eff)
            if best is not None:
                return self._decision(best, "redis_down" if down else "spill", eff, replicas)
            return self._decision(holders[0], "redis_down" if down else "prefix_hit", eff, replicas)
        order = sorted(replicas, key=lambda r: rendezvous_weight(chain[0], r.replica_id), reverse=True)
        slack = self.config.cold_slack
        pick = next((r for r in order if (slack is None or r.ongoing <= min_load + slack)
                     and not self._overloaded(r, min_load)), order[0])
        return self._decision(pick, "redis_down" if down else "cold_hash", eff, order)

    def cold_candidates(self, replicas: Sequence[ReplicaLoad], chain: Sequence[int]) -> list[str]:
        """Where a cold prefix may go, in rendezvous order: the replicas that are not overloaded by the rule
        for a holder of the whole chain (all of them when every one is). The shared claim
        (`cluster/claims.py`) picks among these by claimed cold work. The holder's rule, not the cold one:
        request counts say little about pending prefill (a tenant's 8 new chats are one prompt's prefill),
        and with the cold rule a burst of 4 tenants x 8 chats on 2 workers put 3 new prompts on one worker
        (the first tenant's 8 requests made the other look overloaded), where the claims split them 2:2."""
        min_load = min(r.ongoing for r in replicas)
        order = sorted(replicas, key=lambda r: rendezvous_weight(chain[0], r.replica_id), reverse=True)
        fit = [r.replica_id for r in order if not self._overloaded(r, min_load, len(chain))]
        return fit or [r.replica_id for r in order]

    def follow_claim(self, replicas: Sequence[ReplicaLoad], decision: Decision, owner: str,
                     matched: int = 0) -> Decision:
        """A cold decision moved to ``owner``, the worker the shared claim placed the prefix on (no change
        when ``owner`` is not a candidate). The owner is computing the prefix, so it is judged as a holder of
        ``matched`` chunks: overloaded under that rule, the request spills to the least loaded replica that is
        not (a spill recomputes the prefix there), else it stays with the owner."""
        by_id = {r.replica_id: r for r in replicas}
        r = by_id.get(owner)
        if r is None:
            return decision
        min_load = min(x.ongoing for x in replicas)
        if self._overloaded(r, min_load, matched) and (best := self._spill_target(replicas, min_load, {})):
            return self._decision(best, "spill", {}, replicas)
        if owner == decision.replica_id:
            return decision
        return self._decision(r, decision.reason, {}, replicas)

    def _spill_target(self, replicas: Sequence[ReplicaLoad], min_load: int,
                      eff: Mapping[str, int]) -> ReplicaLoad | None:
        """Where a spilled request goes: the least loaded replica not overloaded for what it holds (more held
        chunks first on a tie), or None when every one is."""
        free = [r for r in replicas if not self._overloaded(r, min_load, eff.get(r.replica_id, 0))]
        return min(free, key=lambda r: (r.ongoing, -eff.get(r.replica_id, 0), r.replica_id), default=None)

    def _least_loaded(self, replicas: Sequence[ReplicaLoad], reason: str, eff: dict[str, int]) -> Decision:
        self._rr += 1
        n = len(replicas)
        best = min(range(n), key=lambda i: (replicas[i].ongoing, (i - self._rr) % n))
        return self._decision(replicas[best], reason, eff, replicas)

    @staticmethod
    def _decision(chosen: ReplicaLoad, reason: str, eff: Mapping[str, int],
                  order: Sequence[ReplicaLoad]) -> Decision:
        rest = sorted((r for r in order if r.replica_id != chosen.replica_id),
                      key=lambda r: (r.ongoing, -eff.get(r.replica_id, 0)))
        return Decision(chosen.replica_id, reason, eff.get(chosen.replica_id, 0),
                        (chosen.replica_id, *(r.replica_id for r in rest)),
                        {r.replica_id: eff[r.replica_id] for r in order if eff.get(r.replica_id, 0) > 0})
