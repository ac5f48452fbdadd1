"""The worker's state model: requests compare by identity, ``num_cached`` is None until admission, and the
cluster publisher reads a hash snapshot the engine thread publishes after each step (never the live tree)."""

from __future__ import annotations

import asyncio
import threading

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


def test_publisher_snapshot_comes_from_the_engine_thread_and_follows_the_cache() -> None:
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
        snap = eng.cached_hashes()
        assert isinstance(snap, tuple) and len(snap) >= 3
        assert set(snap) == set(live(64))  # the engine is idle now: the snapshot is the tree's content
        assert callers and set(callers) == {"chunkserve-engine"}
    finally:
        eng.shutdown()
