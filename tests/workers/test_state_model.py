"""The worker's state model: requests compare by identity, ``num_cached`` is None until admission, and the
cluster publisher reads a hash snapshot the engine thread takes between steps when asked (never the live tree)."""

from __future__ import annotations

import asyncio
import threading
import time

from chunkserve.workers.async_engine import AsyncEngine
from chunkserve.workers.engine import EngineConfig
from chunkserve.workers.protocol import GenerateRequest
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.scheduler import Request

CHUNK = 16


def test_requests_compare_by_identity_and_num_cached_starts_unknown() -> None:
    p = SamplingParams(max_tokens=4)
    a, b = Request("r", [1, 2, 3], p), Request("r", [1, 2, 3], p)
    assert a != b and a == a and len({a, b}) == 2
    assert a.num_cached is None


def test_publisher_snapshot_is_taken_on_the_engine_thread_only_when_asked_and_follows_the_cache() -> None:
    eng = AsyncEngine(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=16, max_model_len=256),
                      hash_snapshot_depth=64)
    try:
        callers: list[str] = []
        live = eng.core.cache.cached_hashes

        def spy(depth: int) -> list[int]:
            callers.append(threading.current_thread().name)
            return live(depth)

        eng.core.cache.cached_hashes = spy  # type: ignore[method-assign]
        assert eng.cached_hashes() == ()
        prompt = tuple((5 * i) % 300 + 1 for i in range(3 * CHUNK + 4))  # 3 full chunks

        async def go() -> int:
            req = GenerateRequest("a", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            return sum([len(d.token_ids) async for d in eng.generate(req)])

        assert asyncio.run(go()) == 3
        assert len(callers) == 1  # the steps that changed the cache took no snapshot: nobody asked
        snap = eng.cached_hashes()
        assert isinstance(snap, tuple) and len(snap) >= 3
        assert set(snap) == set(live(64))  # the engine is idle now: the snapshot is the tree's content
        assert callers == ["chunkserve-engine"] * 2
    finally:
        eng.shutdown()


def test_snapshot_of_a_stopped_engine_is_the_last_one_taken_without_waiting() -> None:
    eng = AsyncEngine(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=16, max_model_len=256),
                      hash_snapshot_depth=64)
    prompt = tuple((7 * i) % 300 + 1 for i in range(2 * CHUNK + 1))

    async def go() -> None:
        req = GenerateRequest("a", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        async for _ in eng.generate(req):
            pass

    asyncio.run(go())
    snap = eng.cached_hashes()
    assert len(snap) >= 2
    eng.shutdown()
    t0 = time.monotonic()
    assert eng.cached_hashes(timeout_s=30.0) == snap
    assert time.monotonic() - t0 < 1.0
