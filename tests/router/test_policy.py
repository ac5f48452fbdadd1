from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from chunkserve.cluster.events import CacheEvent, WorkerPublisher
from chunkserve.cluster.hashing import hash_chain
from chunkserve.cluster.index import AsyncPrefixIndex
from chunkserve.cluster.reader import CachedIndexReader, ReaderConfig
from chunkserve.cluster.redis_server import RedisServer
from chunkserve.router.policy import PolicyConfig, PrefixPolicy, ReplicaLoad, rendezvous_weight

CHAIN = hash_chain(list(range(64)), 8, b"tenant-a")


def _loads(*ongoing: int, capacity: int = 0) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", n, capacity) for i, n in enumerate(ongoing)]


def test_longest_prefix_wins_when_load_is_even() -> None:
    d = PrefixPolicy().decide(_loads(1, 1, 1), CHAIN, {"r0": 2, "r1": 7, "r2": 0})
    assert (d.replica_id, d.reason, d.matched_chunks) == ("r1", "prefix_hit", 7)
    assert d.ranking[0] == "r1" and sorted(d.ranking) == ["r0", "r1", "r2"]


def test_load_trades_against_match_length() -> None:
    pol = PrefixPolicy(PolicyConfig(load_cost_chunks=1.0, spill_abs=100))
    # r1 holds one chunk more but has 3 more requests queued: r0 scores 6 - 0, r1 scores 7 - 3.
    assert pol.decide(_loads(0, 3), CHAIN, {"r0": 6, "r1": 7}).replica_id == "r0"


def test_overloaded_holder_spills_to_least_loaded_and_records_hint() -> None:
    pol = PrefixPolicy(PolicyConfig(spill_abs=4, spill_rel=2.0, spill_per_chunk=0.0))
    d = pol.decide(_loads(6, 1, 2), CHAIN, {"r0": 8})
    assert (d.replica_id, d.reason) == ("r1", "spill")
    pol.record(CHAIN, d.replica_id)
    assert pol.hinted_matches(CHAIN)["r1"] == len(CHAIN)
    # Next request of the hot prefix: r1 now counts as a holder, so it is a hit there.
    d2 = pol.decide(_loads(6, 2, 2), CHAIN, {"r0": 8})
    assert (d2.replica_id, d2.reason) == ("r1", "prefix_hit")


@pytest.mark.parametrize(("loads", "spills"), [
    ((5, 2), False),  # 3 above the least loaded < spill_abs=4
    ((6, 2), False),  # 4 above, but 6 < 2.5 * (2 + 1): the relative threshold holds it back
    ((8, 2), True),   # 6 above and 8 >= 7.5
    ((4, 0), True),   # 4 above and 4 >= 2.5 * 1
    ((3, 0), False),  # only 3 above
])
def test_spill_needs_both_absolute_and_relative_excess(loads: tuple[int, int], spills: bool) -> None:
    pol = PrefixPolicy(PolicyConfig(spill_abs=4, spill_rel=2.5, spill_per_chunk=0.0))
    d = pol.decide(_loads(*loads), CHAIN, {"r0": 8})
    assert (d.reason == "spill") is spills
    assert d.replica_id == ("r1" if spills else "r0")


@pytest.mark.parametrize(("matched", "load", "spills"), [
    (8, 7, False),   # 8 chunks held: 4 + 0.5 * 8 = 8 above the least load needed
    (8, 8, True),
    (16, 11, False),  # a 1,024-token prompt stays put under 11 more requests
    (16, 12, True),
])
def test_a_longer_held_prefix_needs_a_larger_imbalance_to_spill(matched: int, load: int, spills: bool) -> None:
    d = PrefixPolicy().decide(_loads(load, 0), CHAIN, {"r0": matched})
    assert (d.reason == "spill") is spills and d.replica_id == ("r1" if spills else "r0")


def test_full_replica_is_overloaded_even_below_thresholds() -> None:
    d = PrefixPolicy().decide(_loads(2, 1, capacity=2), CHAIN, {"r0": 8})
    assert (d.replica_id, d.reason) == ("r1", "spill")


def test_cold_prefix_goes_by_rendezvous_and_is_stable() -> None:
    replicas = _loads(0, 0, 0, 0)
    firsts = [hash_chain([t] * 8, 8, b"x")[0] for t in range(200)]
    picks = [PrefixPolicy().decide(replicas, [h, 1, 2], {}) for h in firsts]
    assert {p.reason for p in picks} == {"cold_hash"}
    # Deterministic across policy instances (routers), and a function of the first chunk only.
    assert [p.replica_id for p in picks] == [PrefixPolicy().decide(replicas, [h, 9], {}).replica_id
                                              for h in firsts]
    spread = Counter(p.replica_id for p in picks)
    assert len(spread) == 4 and min(spread.values()) > 25
    # Removing a replica only moves the prefixes it owned (rendezvous property).
    fewer = [r for r in replicas if r.replica_id != "r3"]
    for h, p in zip(firsts, picks, strict=True):
        if p.replica_id != "r3":
            assert PrefixPolicy().decide(fewer, [h], {}).replica_id == p.replica_id


def test_cold_prefix_skips_overloaded_rendezvous_owner() -> None:
    h = CHAIN[0]
    owner = max(("r0", "r1"), key=lambda r: rendezvous_weight(h, r))
    loads = [ReplicaLoad(owner, 9), ReplicaLoad("r0" if owner == "r1" else "r1", 0)]
    d = PrefixPolicy().decide(loads, CHAIN, {})
    assert d.replica_id != owner and d.reason == "cold_hash"


def test_with_cold_slack_0_cold_prefixes_arriving_together_spread_over_the_replicas() -> None:
    """4 new prompts at once on 2 replicas: each goes to a least loaded replica (rendezvous among those),
    2 and 2, instead of rendezvous alone (3 or 4 on one replica for half of all prompt sets)."""
    for seed in range(20):
        pol = PrefixPolicy(PolicyConfig(cold_slack=0))
        loads = {"r0": 0, "r1": 0}
        for t in range(4):
            chain = hash_chain([seed * 10 + t] * 8, 8, b"x")
            d = pol.decide([ReplicaLoad(r, n) for r, n in loads.items()], chain, {})
            assert d.reason == "cold_hash"
            loads[d.replica_id] += 1
        assert loads == {"r0": 2, "r1": 2}
    # with slack, the rendezvous owner keeps a cold prefix while it is within the slack of the least load
    h = CHAIN[0]
    owner = max(("r0", "r1"), key=lambda r: rendezvous_weight(h, r))
    other = "r0" if owner == "r1" else "r1"
    loads2 = [ReplicaLoad(owner, 2), ReplicaLoad(other, 0)]
    assert PrefixPolicy(PolicyConfig(cold_slack=2)).decide(loads2, CHAIN, {}).replica_id == owner
    assert PrefixPolicy(PolicyConfig(cold_slack=0)).decide(loads2, CHAIN, {}).replica_id == other
    assert PrefixPolicy().decide(loads2, CHAIN, {}).replica_id == owner  # default: rendezvous below overload


def test_redis_down_falls_back_to_rendezvous_and_hints() -> None:
    pol = PrefixPolicy()
    d = pol.decide(_loads(0, 0, 0), CHAIN, None)
    assert d.reason == "redis_down"
    owner = max(("r0", "r1", "r2"), key=lambda r: rendezvous_weight(CHAIN[0], r))
    assert d.replica_id == owner
    pol.record(CHAIN, "r2")  # e.g. spilled there earlier: local hints still count while Redis is down
    assert pol.decide(_loads(0, 0, 0), CHAIN, None).replica_id == "r2"


def test_no_chain_goes_to_least_loaded_and_rotates_ties() -> None:
    pol = PrefixPolicy()
    assert pol.decide(_loads(3, 1, 2), [], {}).replica_id == "r1"
    picks = {pol.decide(_loads(0, 0, 0), [], {}).replica_id for _ in range(6)}
    assert picks == {"r0", "r1", "r2"}
    assert pol.decide(_loads(0), [], {}).reason == "no_chain"


def test_hints_expire_and_dead_replicas_are_forgotten() -> None:
    now = [0.0]
    pol = PrefixPolicy(PolicyConfig(hint_ttl_s=1.0), clock=lambda: now[0])
    pol.record(CHAIN[:3], "r1")
    pol.record(CHAIN[:3], "r2")
    assert pol.hinted_matches(CHAIN) == {"r1": 3, "r2": 3}
    pol.forget_replica("r2")
    assert pol.hinted_matches(CHAIN) == {"r1": 3}
    now[0] = 2.0
    assert pol.hinted_matches(CHAIN) == {}


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        PolicyConfig(spill_abs=0)
    with pytest.raises(ValueError):
        PolicyConfig(spill_rel=0.5)
    with pytest.raises(ValueError):
        PrefixPolicy().decide([], CHAIN, {})


def test_policy_with_real_index_falls_back_and_recovers(namespace: str) -> None:
    with RedisServer() as srv:
        held = CHAIN[:5]
        pub = WorkerPublisher(srv.url, "r2", namespace=namespace, snapshot=lambda: held, socket_timeout_s=0.3)
        pub.heartbeat()
        pub.publish([CacheEvent("stored", h) for h in held])
        replicas = _loads(0, 0, 0)
        ids = [r.replica_id for r in replicas]

        async def go() -> list[str]:
            reader = CachedIndexReader(lambda: AsyncPrefixIndex(srv.url, namespace=namespace),
                                       ReaderConfig(timeout_s=0.5, cache_ttl_s=0.0, retry_after_s=0.1))
            reasons = []
            for phase in ("up", "down", "back"):
                if phase == "down":
                    srv.stop()
                elif phase == "back":
                    srv.start()
                    pub.heartbeat()
                    await asyncio.sleep(0.15)
                pol = PrefixPolicy()  # fresh policy: no hints, only the index decides
                res = await reader.lookup(CHAIN, ids)
                d = pol.decide(replicas, CHAIN, res.matches)
                reasons.append(f"{d.reason}:{d.replica_id}")
            await reader.aclose()
            return reasons

        up, down, back = asyncio.run(go())
        assert up == "prefix_hit:r2" and back == "prefix_hit:r2"
        assert down.startswith("redis_down:")


def test_router_metrics_count_decisions_by_reason() -> None:
    from chunkserve.router.metrics import RouterMetrics

    m = RouterMetrics(enable_ray=False)
    m.record("spill", 3)
    m.record("prefix_hit", 8)
    m.record("spill", 0)
    assert m.counts["spill"] == 2 and m.counts["prefix_hit"] == 1 and m.counts["redis_down"] == 0
    with pytest.raises(ValueError):
        m.record("lucky", 0)


def test_cold_candidates_are_in_rendezvous_order_without_the_overloaded_and_a_claim_moves_the_decision() -> None:
    h = CHAIN[0]
    order = sorted(("r0", "r1", "r2"), key=lambda r: rendezvous_weight(h, r), reverse=True)
    pol = PrefixPolicy()
    even = [ReplicaLoad(r, 0) for r in ("r0", "r1", "r2")]
    assert pol.cold_candidates(even, CHAIN) == order
    hot = [ReplicaLoad(r, 20 if r == order[0] else 0) for r in ("r0", "r1", "r2")]
    assert pol.cold_candidates(hot, CHAIN) == order[1:]
    d = pol.decide(even, CHAIN, {})
    moved = pol.follow_claim(even, d, order[2])
    assert (d.replica_id, moved.replica_id, moved.reason) == (order[0], order[2], "cold_hash")
    assert moved.ranking[0] == order[2] and set(moved.ranking) == {"r0", "r1", "r2"}
    assert pol.follow_claim(even, d, "gone") == d  # not a candidate: the policy's own choice stands


def test_a_claimed_prefix_is_followed_as_a_held_one_and_spills_only_under_the_holder_rule() -> None:
    """8 requests of one new prompt: the claim's worker already runs 5 of them (over the cold rule's
    threshold against an idle replica), so without the chain counted as held the 6th would recompute the
    prompt elsewhere; with 16 chunks held it stays, and spills only once the gap passes 4 + 0.5 * 16."""
    pol = PrefixPolicy()
    busy = [ReplicaLoad("r0", 5), ReplicaLoad("r1", 0)]
    d = pol.decide(busy, CHAIN, {})
    assert pol._overloaded(busy[0], 0)  # the cold rule alone would leave r0
    kept = pol.follow_claim(busy, d, "r0", matched=16)
    assert kept.replica_id == "r0" and kept.reason == "cold_hash"
    flooded = [ReplicaLoad("r0", 13), ReplicaLoad("r1", 0)]
    spilled = pol.follow_claim(flooded, pol.decide(flooded, CHAIN, {}), "r0", matched=16)
    assert (spilled.replica_id, spilled.reason) == ("r1", "spill")


def test_a_burst_of_one_new_prompts_requests_does_not_shut_its_worker_out_of_new_claims() -> None:
    """A tenant's 8 new chats on r0 are one prefill; the next tenant's new prompt may still be claimed on r0
    (the claims then split new prompts by cold work), until r0 passes the holder's spill threshold."""
    pol = PrefixPolicy()
    chain = list(range(16))
    burst = [ReplicaLoad("r0", 8), ReplicaLoad("r1", 0)]
    assert set(pol.cold_candidates(burst, chain)) == {"r0", "r1"}
    flooded = [ReplicaLoad("r0", 13), ReplicaLoad("r1", 0)]
    assert pol.cold_candidates(flooded, chain) == ["r1"]
