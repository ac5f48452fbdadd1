"""Scheduler order under KV pressure and across tenants (issue 14 item 4, issue 16 item 2).

Driven by `workers/sched_sim.py` (the real Scheduler and PrefixKVCache, no model), so waits are counted
in engine steps and do not depend on the machine's load.
"""

from __future__ import annotations

import random
import statistics

import pytest

from chunkserve.workers.sched_sim import make_sim


def kv_pressure(max_num_seqs: int, fair_share: bool = True, tenants: int = 1, seed: int = 0):
    """32 requests through a 1,152-token pool (18 chunks of 64), one arrival every 2 steps."""
    sim = make_sim(18, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, fair_share=fair_share)
    rng = random.Random(seed)
    work = [([rng.randrange(100, 40000) for _ in range(rng.randint(150, 600))], rng.randint(64, 192))
            for _ in range(32)]

    def arrivals(step: int) -> None:
        i = step // 2
        if step % 2 == 0 and i < len(work):
            sim.add(f"r{i:02d}", work[i][0], work[i][1], tenant=f"t{i % tenants}")

    sim.drain(arrivals=arrivals, arrivals_until=64)
    ids = sorted(sim.arrival)
    waits = [sim.first[r] - sim.arrival[r] for r in ids]
    overtaken = [sum(1 for s in ids if sim.arrival[s] > sim.arrival[r] and sim.first[s] < sim.first[r])
                 for r in ids]
    return sim, waits, overtaken


@pytest.mark.parametrize("max_num_seqs", [64, 4])
def test_kv_pressure_keeps_p99_wait_within_3x_median_and_bounds_overtaking(max_num_seqs: int) -> None:
    sim, waits, overtaken = kv_pressure(max_num_seqs)
    assert len(sim.done) == 32
    assert sim.sched.num_preemptions > 0  # the pool really is under pressure
    p99 = sorted(waits)[round(0.99 * (len(waits) - 1))]
    assert p99 <= 3 * statistics.median(waits), (p99, statistics.median(waits))
    assert max(overtaken) <= max_num_seqs, overtaken
    assert sim.sched.cache.pool.num_free + sim.sched.cache.num_evictable == sim.sched.cache.pool.num_chunks


def test_the_oldest_running_request_is_never_preempted() -> None:
    sim = make_sim(12, max_num_seqs=8, max_num_batched_tokens=512)
    for i in range(6):
        sim.add(f"r{i}", [100 + i] * 100, 200)
    victims: list[tuple[float, int]] = []
    while sim.sched.has_work():
        oldest = min(sim.sched.running, key=lambda r: r.seq) if sim.sched.running else None
        before = oldest.num_preemptions if oldest is not None else 0
        sim.run_step()
        if oldest is not None and oldest.num_preemptions > before:
            victims.append(oldest.seq)
    assert sim.sched.num_preemptions > 0
    assert not victims
    # first-token order equals arrival order for a single tenant
    assert sorted(sim.first, key=lambda r: (sim.first[r], r)) == sorted(sim.first)


def test_fair_share_admits_a_light_tenant_ahead_of_a_heavy_backlog_and_fcfs_does_not() -> None:
    def light_wait(fair: bool) -> int:
        sim = make_sim(64, max_num_seqs=2, max_num_batched_tokens=256, fair_share=fair)
        for i in range(12):
            sim.add(f"h{i}", [200 + i] * 256, 32, tenant="heavy")
        for _ in range(3):
            sim.run_step()
        sim.add("light", [9] * 64, 8, tenant="light")
        sim.drain()
        return sim.first["light"] - sim.arrival["light"]

    fair, fcfs = light_wait(True), light_wait(False)
    assert fair < 40 < fcfs, (fair, fcfs)


def test_fair_share_prefills_a_light_prompt_before_heavy_prompts_already_running() -> None:
    """Running requests' remaining prompt pieces and admissions share one priority order: a light request
    arriving while two long heavy prompts are mid-prefill gets its first token after one step (its prompt
    fits the step's budget), where first come, first served makes it wait for the heavy prefills."""
    def light_wait(fair: bool) -> int:
        sim = make_sim(128, max_num_seqs=8, max_num_batched_tokens=256, fair_share=fair)
        sim.add("h0", [300] * 1024, 4, tenant="heavy")
        sim.add("h1", [400] * 1024, 4, tenant="heavy")
        sim.run_step()  # h0's first 256 prompt tokens
        sim.add("light", [9] * 64, 4, tenant="light")
        sim.drain()
        return sim.first["light"] - sim.arrival["light"]

    fair, fcfs = light_wait(True), light_wait(False)
    assert fair == 1 and fcfs > 4, (fair, fcfs)


@pytest.mark.parametrize("fair", [True, False])
def test_a_light_tenants_first_token_step_carries_no_heavy_prompt_piece_it_cannot_end(fair: bool) -> None:
    """A light chat that goes before a heavy tenant's long prompt ends in a step of its own prompt (and the
    decodes): the heavy piece, which could not end there, takes the next step with the whole budget. First
    come, first served fills the step as before; so does a step whose prompt had no other tenant's work to
    go before (the lone-tenant case of the test above)."""
    sim = make_sim(128, max_num_seqs=8, max_num_batched_tokens=256, fair_share=fair)
    sim.add("h0", [300] * 1024, 4, tenant="heavy")
    sim.run_step()  # h0's first 256 prompt tokens
    sim.add("light", [9] * 100, 4, tenant="light")
    sampled = sim.run_step()
    if fair:
        assert [r.request_id for r in sampled] == ["light"]
        assert sim.reqs["h0"].num_computed == 256  # no heavy piece in the light chat's step
        sim.run_step()
        assert sim.reqs["h0"].num_computed == 256 + 255  # the next step: the light decode and the heavy piece
    else:
        assert sim.reqs["h0"].num_computed == 512  # FCFS: h0's piece fills the step, light waits
        assert "light" not in {r.request_id for r in sampled}


def test_fair_share_is_work_conserving_for_a_lone_tenant() -> None:
    steps = []
    for fair in (True, False):
        sim = make_sim(64, max_num_seqs=4, fair_share=fair)
        for i in range(10):
            sim.add(f"h{i}", [300 + i] * 200, 40, tenant="heavy")
        sim.drain()
        steps.append(sim.step)
    assert steps[0] == steps[1]


def test_weights_split_the_service_of_two_backlogged_tenants() -> None:
    sim = make_sim(256, max_num_seqs=2, max_num_batched_tokens=128)
    for i in range(40):
        sim.add(f"a{i}", [1000 + i] * 128, 16, tenant="a", weight=2.0)
        sim.add(f"b{i}", [5000 + i] * 128, 16, tenant="b", weight=1.0)
    for _ in range(400):
        sim.run_step()
    st = sim.sched.stats()["tenant_sched"]
    served = {t: st[t]["prefill_tokens"] + 2 * st[t]["decode_tokens"] for t in ("a", "b")}
    assert 1.6 < served["a"] / served["b"] < 2.5, served
    assert 0.8 < st["a"]["share"] < 1.25 and 0.8 < st["b"]["share"] < 1.25, st


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    sim = make_sim(256, max_num_seqs=1, max_num_batched_tokens=128)
    for i in range(10):
        sim.add(f"a{i}", [1000 + i] * 128, 16, tenant="a")
    for _ in range(60):
        sim.run_step()
    sim.add("b0", [7] * 128, 16, tenant="b")
    st = sim.sched.fair.tenants
    assert st["b"].counter >= st["a"].counter - 2 * 16 * 2 - 128  # lifted to a's level (within one request)


def test_queueing_time_and_served_tokens_are_counted_per_tenant() -> None:
    sim = make_sim(64, max_num_seqs=4)
    sim.add("x", [5] * 100, 10, tenant="x")
    sim.drain()
    st = sim.sched.stats()["tenant_sched"]["x"]
    assert st["prefill_tokens"] == 100 and st["decode_tokens"] == 9 and st["admitted"] == 1
    assert st["queue_time_s"] >= 0.0


def test_a_full_batch_of_one_tenant_frees_a_slot_for_a_starved_tenant_within_a_step() -> None:
    """8 slots, all held by long heavy decodes: the light tenant's requests each start on the next step
    (one heavy request preempted per light one, its chunks kept cached), and a tenant at its share never
    triggers another preemption (no churn). FCFS waits for a heavy request to finish."""
    def run(fair: bool) -> tuple[list[int], int, int]:
        sim = make_sim(256, max_num_seqs=8, max_num_batched_tokens=512, fair_share=fair)
        for i in range(16):
            sim.add(f"h{i}", [200 + i] * 100, 120, tenant="heavy")
        for _ in range(10):
            sim.run_step()
        for k in range(3):
            sim.add(f"l{k}", [9, k] * 20, 4, tenant="light")
            for _ in range(12):
                sim.run_step()
        pre = sim.sched.num_preemptions
        sim.drain()
        assert len(sim.done) == 19
        return [sim.first[f"l{k}"] - sim.arrival[f"l{k}"] for k in range(3)], pre, sim.sched.num_preemptions

    waits, pre, total = run(True)
    assert max(waits) <= 1, waits
    assert pre == 3 and total == 3  # one per light request, none after
    fcfs_waits, fcfs_pre, _ = run(False)
    assert min(fcfs_waits) > 5 and fcfs_pre == 0, fcfs_waits


def test_a_preempted_request_is_not_readmitted_on_room_that_is_its_own_cached_prefix() -> None:
    """32 distinct 150-600-token prompts through an 18-chunk pool (the chaos KV-pressure load): a preempted
    request's cached chunks are evictable, but they are no room for it once it holds them again. Counting
    them readmitted it every step only for the next decode to preempt it again (89 preemptions here)."""
    rng = random.Random(0)
    sim = make_sim(18, max_num_seqs=8, max_num_batched_tokens=256)
    for i in range(32):
        sim.add(f"r{i}", [rng.randrange(100, 40000) for _ in range(rng.randint(150, 600))], rng.randint(32, 64))
    sim.drain()
    assert len(sim.done) == 32
    assert 0 < sim.sched.num_preemptions <= 10



def _burst(quantum: float, tenants: tuple[str, str] = ("a", "b"), fair_share: bool = True) -> dict[str, int]:
    """Two groups of 4 chats, all at once: a 1,024-token system prompt per group, then a 16-token question
    (the first pass of a multi-tenant chat load); the groups are ``tenants`` (possibly one tenant twice)."""
    sim = make_sim(256, max_num_seqs=16, max_num_batched_tokens=512, fair_quantum=quantum, fair_share=fair_share)
    for k in range(4):
        for g, t, base in (("a", tenants[0], 1000), ("b", tenants[1], 5000)):
            sim.add(f"{g}{k}", [base + i for i in range(1024)] + [90 + k] * 16, 4, tenant=t, salt=b"s")
    sim.drain()
    return sim.first


def test_a_tenants_chats_follow_its_just_computed_system_prompt_before_another_tenants_prompt() -> None:
    """Within the fairness quantum the shortest remaining prompt goes first: once a's system prompt is
    computed, a's other chats (16 new tokens each) get their first tokens before b's 1,040-token prompt is
    done; strict VTC order (quantum 0) alternates the two prompts and every chat waits for both."""
    first = _burst(2048.0)
    assert max(first[f"a{k}"] for k in range(4)) < min(first[f"b{k}"] for k in range(4)), first
    strict = _burst(0.0)
    assert min(strict.values()) == max(strict.values()), strict  # all at the end of both prompts
    assert max(first[f"a{k}"] for k in range(4)) < min(strict.values())


def test_chats_that_share_a_just_computed_prompt_go_before_the_next_whole_prompt_of_the_same_tenant() -> None:
    """One tenant (open mode): chats with at most two chunks of prompt left go before its older requests'
    whole prompts; first come, first served makes every chat wait for both prompts."""
    first = _burst(2048.0, ("public", "public"))
    assert max(first[f"a{k}"] for k in range(4)) < min(first[f"b{k}"] for k in range(4)), first
    fcfs = _burst(2048.0, ("public", "public"), fair_share=False)
    assert max(fcfs[f"a{k}"] for k in range(1, 4)) >= max(fcfs[f"b{k}"] for k in range(4)) - 1, fcfs


def test_the_quantum_bounds_how_far_shorter_work_runs_ahead_of_a_long_prompt() -> None:
    """A tenant with a 2,048-token prompt waits while another's short prompts go first, but only until that
    tenant has been served the quantum (plus one step's budget) more than it."""
    quantum, budget = 512.0, 128
    sim = make_sim(512, max_num_seqs=64, max_num_batched_tokens=budget, fair_quantum=quantum)
    sim.add("long", [3] * 2048, 1, tenant="long")
    for i in range(40):
        sim.add(f"s{i}", [10_000 + 100 * i + j for j in range(64)], 1, tenant="short")
    long_req = sim.reqs["long"]
    served_before = None
    while sim.sched.has_work() and served_before is None:
        short_served = sim.sched.fair.tenants["short"].prefill_tokens
        sim.run_step()
        if long_req.num_computed > 0:
            served_before = short_served
    assert served_before is not None
    assert 0 < served_before <= quantum + budget, served_before


def test_cheap_chats_overtake_an_older_long_prompt_of_their_tenant_by_at_most_the_quantum() -> None:
    """Aging bound: chats whose prompt is cached but for 16 tokens go before an older 2,048-token prompt of
    the same tenant until they have been given ``fair_quantum`` prompt tokens; then the long prompt goes."""
    quantum, budget = 256.0, 128
    sim = make_sim(512, max_num_seqs=64, max_num_batched_tokens=budget, fair_quantum=quantum)
    prefix = [7_000 + i for i in range(512)]
    sim.add("p0", prefix + [1] * 16, 1)
    sim.drain()  # the shared prefix is cached
    sim.add("long", [3] * 2048, 1)
    for i in range(60):
        sim.add(f"c{i}", prefix + [20_000 + 100 * i + j for j in range(16)], 1)
    long_req = sim.reqs["long"]
    cheap_before = None
    while sim.sched.has_work() and cheap_before is None:
        done = sum(16 for r, st in sim.first.items() if r.startswith("c"))
        sim.run_step()
        if long_req.num_computed > 0:
            cheap_before = done
    assert cheap_before is not None
    assert 0 < cheap_before <= quantum + budget, cheap_before



@pytest.mark.parametrize("chats", [4, 2])
def test_a_step_that_ends_four_prompts_takes_no_piece_it_cannot_end(chats: int) -> None:
    """Four chats whose prompt is cached but for 16 tokens end in one step; a piece of a 2,048-token prompt
    would only delay their first tokens, so it waits for the next step (with the whole budget). A step that
    ends fewer prompts still fills its budget."""
    sim = make_sim(256, max_num_seqs=16, max_num_batched_tokens=512)
    prefix = [7_000 + i for i in range(512)]
    sim.add("p0", prefix + [1] * 16, 1)
    sim.drain()
    for i in range(chats):
        sim.add(f"c{i}", prefix + [20_000 + 100 * i + j for j in range(16)], 1)
    sim.add("long", [3] * 2048, 1)
    sampled = sim.run_step()
    assert {r.request_id for r in sampled} == {f"c{i}" for i in range(chats)}
    assert sim.reqs["long"].num_computed == (0 if chats >= 4 else 512 - 16 * chats)


def test_a_step_that_holds_its_first_tokens_passes_over_long_prompts_to_chats_that_arrived_behind_them() -> None:
    """Open mode, a burst: a system prompt is computed, then 4 of its chats, 8 distinct long prompts and 2 more
    chats arrive. The step that ends the first chats also ends the last two (only 16 new tokens each), though
    more than `SCAN_WAITING` long prompts arrived before them; the long prompts wait for the next step."""
    sim = make_sim(512, max_num_seqs=32, max_num_batched_tokens=512)
    prefix = [7_000 + i for i in range(512)]
    sim.add("p0", prefix + [1] * 16, 1)
    sim.drain()
    chat = [f"c{i}" for i in range(6)]
    for rid in chat[:4]:
        sim.add(rid, prefix + [20_000 + 100 * int(rid[1:]) + j for j in range(16)], 1)
    for i in range(8):
        sim.add(f"long{i}", [30_000 + 1_000 * i + j for j in range(1_024)], 1)
    for rid in chat[4:]:
        sim.add(rid, prefix + [20_000 + 100 * int(rid[1:]) + j for j in range(16)], 1)
    sampled = sim.run_step()
    assert {r.request_id for r in sampled} == set(chat)
    assert all(sim.reqs[f"long{i}"].num_computed == 0 for i in range(8))


def test_a_prompt_already_being_prefilled_finishes_before_an_older_arrivals_prompt_of_its_tenant_starts() -> None:
    """The frontend's arrival stamps order the queue, so a request stamped earlier can reach the engine after
    another one started its prompt (the burst of a first pass). The started prompt goes on: it ends in the
    next step, rather than waiting for the older arrival's whole prompt."""
    now = [10.0]
    sim = make_sim(256, clock=lambda: now[0], max_num_seqs=16, max_num_batched_tokens=512)
    sim.add("started", [1_000 + i for i in range(1_000)], 1)
    sim.run_step()  # 512 of its 1,000 tokens
    now[0] = 5.0  # stamped before it by the frontend, arriving now
    sim.add("older", [5_000 + i for i in range(1_000)], 1)
    now[0] = 11.0
    sampled = sim.run_step()
    assert [r.request_id for r in sampled] == ["started"]
    assert sim.reqs["older"].num_computed == 512 - (1_000 - 512)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), True, "2048"])
def test_a_bad_fair_quantum_is_refused_when_the_engine_config_is_built(bad: object) -> None:
    from chunkserve.workers.engine_config import EngineConfig
    from chunkserve.workers.fairness import FairnessConfig

    with pytest.raises(ValueError, match="fair_quantum"):
        EngineConfig(fair_quantum=bad)  # type: ignore[arg-type]
    if isinstance(bad, float):
        with pytest.raises(ValueError, match="quantum"):
            FairnessConfig(quantum=bad)
