"""cache_control pins at the worker (issue 16): survival under a flood, TTL expiry, renewal, quotas,
the pool's pin share, isolation. Driven by `workers/sched_sim.py` (real Scheduler and cache, no model)."""

from __future__ import annotations

import random

import pytest

from chunkserve.workers.cache_control import PinSpec
from chunkserve.workers.protocol import PinRefusedError
from chunkserve.workers.sched_sim import make_sim

PREFIX = [random.Random(1).randrange(100, 40000) for _ in range(4096)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def flood(sim, tokens: int, tenant: str = "other", seed: int = 2) -> None:
    """Distinct prompts of another tenant, ``tokens`` in all, run to completion."""
    rng = random.Random(seed)
    for i in range(tokens // 2048):
        sim.add(f"flood-{seed}-{i}", [rng.randrange(100, 40000) for _ in range(2048)], 2, tenant=tenant)
    sim.drain()


def spec(ttl: float = 300.0, quota: int = 8192, on_full: str = "error") -> PinSpec:
    return PinSpec(num_tokens=len(PREFIX), ttl_s=ttl, quota_tokens=quota, on_pool_full=on_full)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_4096_token_prefix_survives_a_flood_of_5x_the_pool(pinned: bool) -> None:
    sim = make_sim(192)  # 12,288 tokens
    first = sim.add("a1", PREFIX + [5] * 50, 2, tenant="acme", pin=spec() if pinned else None)
    sim.drain()
    assert first.pinned_tokens == (4096 if pinned else 0)
    assert first.cache_creation_tokens == (4096 if pinned else 0)
    flood(sim, 5 * 192 * 64)
    again = sim.add("a2", PREFIX + [6] * 50, 2, tenant="acme")
    sim.drain()
    if pinned:
        assert again.num_cached >= 4032
    else:
        assert again.num_cached < 64  # evicted by the flood


def test_a_pin_past_its_ttl_is_released_and_then_evicted_like_any_chunk() -> None:
    clock = Clock()
    sim = make_sim(192, clock=clock)
    sim.add("a1", PREFIX, 2, tenant="acme", pin=spec(ttl=300.0))
    sim.drain()
    clock.t += 200
    flood(sim, 2 * 192 * 64, seed=3)
    assert sim.sched.cache.num_pinned_chunks == 64  # still pinned before the TTL
    clock.t += 101
    flood(sim, 2 * 192 * 64, seed=4)  # the first step releases it, the flood then evicts it
    st = sim.sched.stats()["tenant_sched"]["acme"]
    assert st["pins_expired"] == 1 and st["pinned_tokens"] == 0
    assert sim.sched.cache.num_pinned_chunks == 0
    assert sim.sched.cache.match(PREFIX, b"acme") < 64


def test_a_repeat_request_renews_the_ttl() -> None:
    clock = Clock()
    sim = make_sim(192, clock=clock)
    sim.add("a1", PREFIX + [1], 2, tenant="acme", pin=spec(ttl=300.0))
    sim.drain()
    clock.t += 250
    again = sim.add("a2", PREFIX + [2], 2, tenant="acme", pin=spec(ttl=300.0))
    sim.drain()
    assert again.pinned_tokens == 4096 and again.cache_creation_tokens == 0  # read, not written
    clock.t += 100  # 350 s after the first pin, 100 s after the renewal
    flood(sim, 2 * 192 * 64)
    st = sim.sched.stats()["tenant_sched"]["acme"]
    assert st["pins_renewed"] == 1 and st["pins_expired"] == 0 and st["pins"] == 1
    assert sim.sched.cache.match(PREFIX, b"acme") == 4096


def test_the_pinned_token_quota_is_enforced_by_error_or_unpinned_service() -> None:
    sim = make_sim(256)
    with pytest.raises(PinRefusedError, match="quota"):
        sim.add("a1", PREFIX, 2, tenant="acme", pin=spec(quota=2048))
    assert not sim.sched.has_work()
    req = sim.add("a2", PREFIX, 2, tenant="acme", pin=spec(quota=2048, on_full="unpinned"))
    sim.drain()
    assert req.status.value == "finished" and req.pinned_tokens == 0
    assert sim.sched.cache.num_pinned_chunks == 0
    assert sim.sched.stats()["tenant_sched"]["acme"]["pins_refused"] == 2


def test_pins_hold_at_most_their_share_of_the_pool_and_never_block_another_tenant() -> None:
    sim = make_sim(160, max_pinned_fraction=0.5)  # at most 80 chunks pinned
    sim.add("a1", PREFIX, 2, tenant="a", pin=spec())  # 64 chunks
    sim.drain()
    other = [7] * 4096
    with pytest.raises(PinRefusedError, match="share for pins") as refused:
        sim.add("b1", other, 2, tenant="b", salt=b"b", pin=spec())
    # the message a private tenant reads names the pool's share and its own pin, not what tenant a holds
    assert str(refused.value) == f"the KV pool's share for pins ({80 * 64} tokens) has no room for a pin of 4096 tokens now"
    # the rest of the pool still serves a large request of another tenant
    big = sim.add("b2", [8] * (95 * 64 - 10), 4, tenant="b")
    sim.drain()
    assert big.status.value == "finished" and len(big.output) == 4
    assert sim.sched.cache.num_pinned_chunks == 64


def test_a_private_pin_is_never_visible_to_another_tenant() -> None:
    sim = make_sim(192)
    sim.add("a1", PREFIX, 2, tenant="a", pin=spec())
    sim.drain()
    b = sim.add("b1", PREFIX + [3], 2, tenant="b")
    sim.drain()
    assert b.num_cached == 0  # b computed it again in its own scope
    assert sim.sched.cache.num_pinned_chunks == 64  # and b's copy is not pinned
    assert "b" not in sim.sched.stats()["tenant_sched"] or sim.sched.stats()["tenant_sched"]["b"].get("pins", 0) == 0


def test_a_request_over_its_own_pinned_prefix_is_not_refused_for_the_pinned_room() -> None:
    from chunkserve.workers.engine import EngineConfig, EngineCore
    from chunkserve.workers.sampling import SamplingParams

    core = EngineCore(EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=16, max_model_len=1024))
    prefix = list(range(100, 228))  # 8 chunks: all that the pool's pin share (0.5) allows
    params = SamplingParams(max_tokens=1, temperature=0.0)
    core.add_request("a", prefix + [1], params, b"t", tenant="t", cache_pin=PinSpec(128, 300.0, 1024))
    while core.has_work():
        core.step()
    assert core.cache.num_pinned_chunks == 8
    req = core.add_request("b", prefix + list(range(300, 310)), params, b"t", tenant="t")  # 9 chunks > 8 unpinned
    while core.has_work():
        core.step()
    assert req.num_cached == 128 and len(req.output) == 1


def test_a_pin_that_would_leave_a_queued_request_no_room_is_refused_and_the_request_runs():
    """A request queued before a pin was taken passed the pool check with the pool as it was; the pin must not
    take the room it needs (it used to wait for the pin to expire, up to an hour)."""
    from chunkserve.workers.cache_control import PinSpec
    from chunkserve.workers.engine import EngineConfig, EngineCore
    from chunkserve.workers.sampling import SamplingParams

    core = EngineCore(EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=8, max_model_len=256,
                                   num_threads=1))
    two = SamplingParams(max_tokens=2, temperature=0.0)
    pinned = core.add_request("P", list(range(1, 71)), two,  # marks 64 tokens: 4 chunks, the pool's pin share
                              cache_pin=PinSpec(num_tokens=64, ttl_s=300, quota_tokens=10_000))
    core.add_request("L", list(range(500, 600)), two)  # 7 chunks: fits the pool as long as nothing is pinned
    ends = {}
    for _ in range(40):
        ends.update({o.req.request_id: o.finish_reason for o in core.step() if o.finish_reason})
    assert ends == {"P": "length", "L": "length"}
    assert pinned.pinned_tokens == 0 and core.scheduler.pins.tenants["public"].refused == 1
    alone = core.add_request("P2", list(range(1, 71)), two,
                             cache_pin=PinSpec(num_tokens=64, ttl_s=300, quota_tokens=10_000))
    while core.has_work():
        core.step()
    assert alone.pinned_tokens == 64  # with nothing queued the same pin is taken
