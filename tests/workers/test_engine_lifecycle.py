"""Lifecycle edges of the engine thread and the core: a caller that gives up on an engine call, a step that
fails after another request of it ended, `abort()` on an open stream, pins that expire while the engine is
idle, a dead engine's readiness, and the index events of a failed step."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from chunkserve.router.engine_client import LocalEngineClient
from chunkserve.workers.async_engine import AsyncEngine
from chunkserve.workers.cache_control import PinSpec
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.protocol import EngineError, GenerateRequest
from chunkserve.workers.sampling import SamplingParams


def _cfg(**kw: Any) -> EngineConfig:
    return EngineConfig(**{"model": "random:tiny", "chunk_size": 16, "num_kv_chunks": 16, "max_model_len": 256,
                           "num_threads": 1, "warmup": False, **kw})


def _req(rid: str, prompt: list[int], max_tokens: int = 8, **kw: Any) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True), **kw)


async def _finish(eng: AsyncEngine, req: GenerateRequest) -> str:
    try:
        return str([d async for d in eng.generate(req)][-1].finish_reason)
    except EngineError as e:
        return type(e).__name__


def test_a_caller_that_gives_up_on_an_engine_call_does_not_kill_the_engine_thread() -> None:
    """A cancelled call's future refused its result on the engine thread (InvalidStateError, twice), which
    killed the thread and failed every request in flight."""
    eng = AsyncEngine(_cfg())
    run = eng.core.runner.run
    eng.core.runner.run = lambda plan: (time.sleep(0.3), run(plan))[1]  # a long step (a big prefill)

    async def main() -> str:
        a = asyncio.create_task(_finish(eng, _req("a", list(range(1, 40)), 4)))
        await asyncio.sleep(0.1)  # the step is running
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(eng.forest_summary(), timeout=0.05)
        return await a

    try:
        assert asyncio.run(main()) == "length"
        eng.check_alive()
        assert asyncio.run(_finish(eng, _req("b", [1, 2, 3], 2))) == "length"
    finally:
        eng.shutdown()


def test_a_request_that_ended_in_a_step_that_then_failed_is_reported_failed() -> None:
    """A ended in `_process` before B's output raised: A was already forgotten, so it was in no failure list and
    its stream waited for ever."""
    core = EngineCore(_cfg())
    core.add_request("A", [5, 6, 7, 8], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    core.add_request("B", [1, 2, 3, 4], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    ended = []
    finish = core.scheduler.finish
    core.scheduler.finish = lambda r, why: (ended.append(r.request_id), finish(r, why))[1]

    def add(tok: int, final: bool = False) -> tuple[str, bool]:
        if ended:
            raise RuntimeError("a bug in B's output")
        return real_add(tok, final)

    real_add = core._detok["B"].add
    core._detok["B"].add = add
    with pytest.raises(RuntimeError, match="a bug"):
        core.step()
    assert ended == ["A"] and sorted(core.failed_requests) == ["A", "B"]


def test_abort_ends_the_open_stream_with_finish_reason_abort() -> None:
    eng = AsyncEngine(_cfg())

    async def main() -> tuple[str | None, int]:
        last = None
        n = 0
        async for d in eng.generate(_req("r", [1, 2, 3], 200)):
            n += len(d.token_ids)
            last = d
            if n == 2:
                await eng.abort(d.request_id)
        return (last.finish_reason if last else None), n

    try:
        reason, n = asyncio.run(asyncio.wait_for(main(), timeout=10))
        assert reason == "abort" and 2 <= n < 200
        assert not eng.core.has_work()
    finally:
        eng.shutdown()


def test_a_pin_past_its_ttl_stops_counting_though_the_engine_stayed_idle() -> None:
    """Pins expired only in a step: after an idle spell an expired pin still held its chunks (a prompt that fits
    the pool got 413) and its tenant's quota (a new pin got 429)."""
    eng = AsyncEngine(_cfg(num_kv_chunks=16, max_pinned_fraction=0.5))
    pin = PinSpec(num_tokens=128, ttl_s=0.5, quota_tokens=128, on_pool_full="error")

    async def main() -> list[str]:
        out = [await _finish(eng, _req("p", list(range(1, 129)) + [200], 2, tenant="a", cache_pin=pin))]
        await asyncio.sleep(1.0)  # past the TTL, with nothing to step
        out.append(await _finish(eng, _req("big", [300 + i for i in range(150)], 2, tenant="b")))
        again = PinSpec(num_tokens=64, ttl_s=60, quota_tokens=128, on_pool_full="error")
        out.append(await _finish(eng, _req("p2", [500 + i for i in range(64)] + [1], 2, tenant="a",
                                           cache_pin=again)))
        return out

    try:
        assert asyncio.run(main()) == ["length", "length", "length"]
    finally:
        eng.shutdown()


def test_an_in_process_engine_that_died_is_not_ready() -> None:
    eng = AsyncEngine(_cfg())
    client = LocalEngineClient(eng)
    assert asyncio.run(client.readiness())["ready"] is True
    eng.shutdown()
    state = asyncio.run(client.readiness())
    assert state["ready"] is False and state["reason"]


def test_the_evictions_of_a_failed_step_reach_the_index_publisher_at_once() -> None:
    """The failed step emptied the cache but its evictions stayed queued in the cache until a later step
    succeeded, so the index kept advertising the dropped prefixes to routers while the worker was idle."""
    eng = AsyncEngine(_cfg(), hash_snapshot_depth=64)
    woken: list[float] = []
    eng.on_cache_events(lambda: woken.append(time.monotonic()))

    async def main() -> None:
        assert await _finish(eng, _req("a", list(range(1, 50)), 2)) == "length"
        await asyncio.sleep(0.2)
        assert "stored" in [e.kind for e in eng.drain_cache_events()]
        n = len(woken)
        run = eng.core.runner.run

        def boom(plan: Any) -> Any:
            raise RuntimeError("forward failed")

        eng.core.runner.run = boom
        assert await _finish(eng, _req("b", list(range(100, 120)), 2)) == "EngineStepError"
        eng.core.runner.run = run
        await asyncio.sleep(0.3)
        assert len(woken) > n and "evicted" in [e.kind for e in eng.drain_cache_events()]

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_a_too_large_prompts_error_says_nothing_of_other_tenants_pins() -> None:
    """The 413 named the pool less every tenant's pinned chunks: a private tenant read another's pins (their
    size, creation, renewal, expiry) from its own error messages."""
    core = EngineCore(_cfg(num_kv_chunks=64, max_pinned_fraction=0.5, max_model_len=2048))
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def refusal() -> str:
        with pytest.raises(EngineError) as e:
            core.add_request("probe", [7] * 1100, greedy, b"beta", tenant="beta")
        return str(e.value)

    before = refusal()
    assert "KV pool" in before
    pin = PinSpec(num_tokens=208, ttl_s=300.0, quota_tokens=4096, on_pool_full="error")
    core.add_request("alpha", list(range(1, 230)), greedy, b"alpha", tenant="alpha", cache_pin=pin)
    while core.has_work():
        core.step()
    assert core.cache.num_pinned_chunks > 0
    assert refusal() == before
