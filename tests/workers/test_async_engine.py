"""AsyncEngine over a real tiny engine: coalesced streams, typed errors, shutdown; and `coalesce` itself."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest

from chunkserve.workers.async_engine import AsyncEngine
from chunkserve.workers.async_engine import EngineError as ReExportedEngineError
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.protocol import (
    EngineDeadError,
    EngineError,
    EngineStepError,
    FirstTokenTimeline,
    GenerateDelta,
    GenerateRequest,
    InvalidRequestError,
    KVPoolTooSmallError,
    PromptTooLongError,
)
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.streaming import StreamBatching, coalesce, merge_deltas

CHUNK = 16


def delta(i: int, finish: str | None = None, rid: str = "r") -> GenerateDelta:
    return GenerateDelta(request_id=rid, token_ids=[100 + i], text=f"t{i} ", num_prompt_tokens=7,
                         num_cached_tokens=3, num_output_tokens=i + 1, finish_reason=finish,
                         logprobs=[-float(i)], first_token_time=12.5 if i == 0 else None)


async def collect(q: asyncio.Queue, batching: StreamBatching) -> list[GenerateDelta]:
    return [d async for d in coalesce(q, batching)]


# ---- coalesce ----------------------------------------------------------------------------------------------
def test_a_burst_within_the_interval_arrives_as_fewer_items_with_the_first_token_alone() -> None:
    async def main() -> list[GenerateDelta]:
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        q.put_nowait(delta(0))
        # the rest comes in a burst shortly after the first token went out (faster than the interval)
        loop.call_later(0.01, lambda: [q.put_nowait(delta(i, "length" if i == 11 else None)) for i in range(1, 12)])
        return await collect(q, StreamBatching(interval_s=0.05, max_tokens=64))

    items = asyncio.run(main())
    assert items[0].token_ids == [100] and items[0].first_token_time == 12.5
    assert len(items) < 12
    plain = [delta(i, "length" if i == 11 else None) for i in range(12)]
    assert [t for d in items for t in d.token_ids] == [t for d in plain for t in d.token_ids]
    assert "".join(d.text for d in items) == "".join(d.text for d in plain)
    assert [lp for d in items for lp in d.logprobs] == [-float(i) for i in range(12)]
    last = items[-1]
    assert last.finish_reason == "length" and last.num_output_tokens == 12
    assert (last.num_prompt_tokens, last.num_cached_tokens) == (7, 3)
    assert all(d.finish_reason is None for d in items[:-1])


def test_slow_deltas_are_sent_at_once_and_fast_ones_are_capped_at_max_tokens() -> None:
    async def timed(gap_s: float, n: int, batching: StreamBatching) -> list[tuple[float, GenerateDelta]]:
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(n):  # equal times may fire out of order: those go in at once, in order
            d = delta(i, "stop" if i == n - 1 else None)
            if gap_s:
                loop.call_at(t0 + i * gap_s, q.put_nowait, d)
            else:
                q.put_nowait(d)
        return [(loop.time() - t0, d) async for d in coalesce(q, batching)]

    # gaps of 0.3 s against a 0.02 s interval: a pause of the machine up to ~0.25 s still leaves them apart
    slow = asyncio.run(timed(0.3, 4, StreamBatching(interval_s=0.02, max_tokens=8)))
    assert [len(d.token_ids) for _, d in slow] == [1, 1, 1, 1]  # slower than the interval: never held back
    for i, (t, _) in enumerate(slow):
        assert t < i * 0.3 + 0.25
    burst = asyncio.run(timed(0.0, 20, StreamBatching(interval_s=0.2, max_tokens=5)))
    sizes = [len(d.token_ids) for _, d in burst]
    assert sizes[0] == 1 and max(sizes) <= 5 and sum(sizes) == 20
    assert burst[-1][0] < 0.18  # queued deltas are drained without waiting out the interval (4 x 0.2 s if not)


def test_the_interval_stretches_with_the_streams_in_flight_and_a_lone_stream_keeps_the_base() -> None:
    b = StreamBatching(interval_s=0.02, max_tokens=64, items_per_s=80.0, max_interval_s=0.2)
    assert b.interval_for(1) == 0.02 and b.interval_for(8) == pytest.approx(0.1)
    assert b.interval_for(1000) == 0.2 and StreamBatching(interval_s=0.02).interval_for(1000) == 0.02

    async def items(streams: int) -> list[GenerateDelta]:
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(30):  # one token every 10 ms
            loop.call_at(t0 + i * 0.01, q.put_nowait, delta(i, "length" if i == 29 else None))
        return [d async for d in coalesce(q, b, lambda: streams)]

    alone, busy = asyncio.run(items(1)), asyncio.run(items(8))
    # late timers only merge more, so the bounds that hold on a loaded machine are upper ones
    assert len(alone) <= 20  # about one item per 20 ms
    assert len(busy) <= 6 and len(busy) < len(alone)  # about one per 100 ms: 8 streams, ~80 items/s
    for got in (alone, busy):
        assert [t for d in got for t in d.token_ids] == [100 + i for i in range(30)]
        assert got[0].token_ids == [100] and got[-1].finish_reason == "length"


def test_an_error_after_some_tokens_is_raised_after_those_tokens_arrive() -> None:
    async def main() -> tuple[list[int], BaseException | None]:
        q: asyncio.Queue = asyncio.Queue()
        for i in range(3):
            q.put_nowait(delta(i))
        q.put_nowait(EngineStepError("engine step failed: boom"))
        got: list[int] = []
        try:
            async for d in coalesce(q, StreamBatching(interval_s=0.05, max_tokens=8)):
                got += d.token_ids
        except EngineError as e:
            return got, e
        return got, None

    got, err = asyncio.run(main())
    assert got == [100, 101, 102] and isinstance(err, EngineStepError)


def test_merge_keeps_logprobs_absent_when_no_delta_has_them() -> None:
    a, b = delta(0), delta(1, "stop")
    a.logprobs = b.logprobs = None
    m = merge_deltas([a, b])
    assert m.logprobs is None and m.token_ids == [100, 101] and m.first_token_time == 12.5


def test_merge_keeps_the_last_deltas_cache_counters() -> None:
    a, b = delta(0), delta(1, "stop")
    b.num_cached_tokens, b.num_cache_creation_tokens, b.num_output_tokens = 64, 128, 2
    m = merge_deltas([a, b])
    assert (m.num_cached_tokens, m.num_cache_creation_tokens, m.num_output_tokens) == (64, 128, 2)
    assert m.finish_reason == "stop" and m.token_ids == [100, 101]


def test_merge_keeps_the_first_tokens_timeline() -> None:
    a, b = delta(0), delta(1)
    a.timeline = FirstTokenTimeline(worker_s=1.0, intake_s=1.5, admitted_s=1.5, first_token_s=2.0)
    assert merge_deltas([a, b]).timeline == a.timeline and merge_deltas([b, delta(2)]).timeline is None


def test_stream_batching_rejects_bad_options() -> None:
    with pytest.raises(ValueError):
        StreamBatching(interval_s=-1)
    with pytest.raises(ValueError):
        StreamBatching(max_tokens=0)
    for bad in ({"items_per_s": -1.0}, {"items_per_s": float("inf")}, {"max_interval_s": 2.0}):
        with pytest.raises(ValueError):
            StreamBatching(**bad)
    assert not StreamBatching(interval_s=0).enabled and StreamBatching().enabled


# ---- errors ------------------------------------------------------------------------------------------------
def test_typed_errors_pickle_and_the_async_engine_module_reexports_the_base() -> None:
    assert ReExportedEngineError is EngineError
    for cls in (PromptTooLongError, KVPoolTooSmallError, EngineStepError, EngineDeadError):
        e = pickle.loads(pickle.dumps(cls("why")))
        assert type(e) is cls and str(e) == "why" and isinstance(e, EngineError)
    assert issubclass(PromptTooLongError, ValueError) and not issubclass(EngineDeadError, ValueError)


def test_protocol_and_streaming_import_without_torch() -> None:
    code = ("import sys, chunkserve.workers.protocol, chunkserve.workers.streaming, chunkserve.workers.sampling; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# ---- the real engine -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=8, max_model_len=256))
    yield eng
    eng.shutdown()


def request(rid: str, prompt: list[int], max_tokens: int = 24) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=True, logprobs=True))


async def run(engine: AsyncEngine, req: GenerateRequest, batching: StreamBatching | None) -> list[GenerateDelta]:
    return [d async for d in engine.generate(req, batching)]


def test_coalesced_engine_stream_has_the_same_tokens_text_and_usage_as_the_plain_one(engine) -> None:
    prompt = [(7 * i) % 400 + 1 for i in range(20)]
    plain = asyncio.run(run(engine, request("plain", prompt), None))
    # its own cache scope: the same fresh prefill as the plain one (a prompt served from the plain one's cached chunk
    # splits its attention differently, and a bf16 model's logprobs then differ in the fourth digit)
    merged_req = replace(request("merged", prompt), cache_salt=b"merged")
    merged = asyncio.run(run(engine, merged_req, StreamBatching(interval_s=0.2, max_tokens=64)))
    assert len(plain) == 24 and all(len(d.token_ids) == 1 for d in plain)
    assert len(merged[0].token_ids) == 1 and merged[0].first_token_time is not None
    assert len(merged) <= len(plain)
    assert [t for d in merged for t in d.token_ids] == [t for d in plain for t in d.token_ids]
    assert "".join(d.text for d in merged) == "".join(d.text for d in plain)
    assert [lp for d in merged for lp in d.logprobs] == pytest.approx([lp for d in plain for lp in d.logprobs])
    assert merged[-1].finish_reason == plain[-1].finish_reason == "length"
    assert merged[-1].num_output_tokens == plain[-1].num_output_tokens == 24
    assert merged[-1].num_prompt_tokens == plain[-1].num_prompt_tokens == 20


@pytest.mark.parametrize("prompt,error", [
    (list(range(1, 300)), PromptTooLongError),      # beyond the 256-token context
    (list(range(1, 200)), KVPoolTooSmallError),     # 13 chunks of 16 > the pool's 8
    ([], InvalidRequestError),
    ([10**6], InvalidRequestError),
])
def test_requests_the_engine_cannot_serve_fail_with_their_error_type_and_the_engine_goes_on(engine, prompt, error):
    with pytest.raises(error) as ei:
        asyncio.run(run(engine, request(f"bad-{error.__name__}-{len(prompt)}", prompt), StreamBatching()))
    assert str(ei.value)
    ok = asyncio.run(run(engine, request(f"ok-after-{error.__name__}-{len(prompt)}", [1, 2, 3], 4), None))
    assert ok[-1].finish_reason == "length"


def test_a_failing_step_fails_its_requests_with_engine_step_error() -> None:
    eng = AsyncEngine(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=8))
    try:
        def broken(plan):
            raise RuntimeError("kernel exploded")

        eng.core.runner.run = broken
        with pytest.raises(EngineStepError, match="kernel exploded"):
            asyncio.run(run(eng, request("doomed", [1, 2, 3]), None))
        assert eng.core.stats()["num_sequences"] == 0
    finally:
        eng.shutdown()


def test_a_failed_step_leaves_no_unwritten_chunk_for_a_retry_to_reuse() -> None:
    """The step puts its new chunks in the prefix tree before the forward writes them: after a failed forward
    a retry of the same prompt must not read them (it used to get 40 'cached' tokens of garbage)."""
    core = EngineCore(EngineConfig(model="random:tiny", chunk_size=16, num_kv_chunks=8, max_model_len=256,
                                   num_threads=1))
    prompt = [(37 * i) % 199 + 1 for i in range(40)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)

    def run(rid: str) -> tuple[list[int], int | None]:
        req = core.add_request(rid, prompt, greedy)
        out: list[int] = []
        while core.has_work():
            out += [t for o in core.step() for t in o.token_ids]
        return out, req.num_cached

    reference, _ = run("ref")
    core.cache.clear()
    core.cache.k_pool.normal_(0, 3)  # what a chunk holds before the forward writes it
    core.cache.v_pool.normal_(0, 3)
    core.add_request("doomed", prompt, greedy)
    core.add_request("queued", [5, 6, 7], greedy)
    real = core.runner.run

    def boom(plan):  # type: ignore[no-untyped-def]
        raise RuntimeError("the forward failed")

    core.runner.run = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        core.step()
    core.runner.run = real  # type: ignore[method-assign]
    assert sorted(core.failed_requests) == ["doomed", "queued"] and not core.has_work()
    st = core.stats()
    assert st["kv_chunks_used"] == 0 and st["kv_chunks_cached"] == 0
    assert run("retry") == (reference, 0)


def test_a_shut_down_engine_fails_running_and_new_requests_with_engine_dead_error() -> None:
    eng = AsyncEngine(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=64))

    async def main() -> tuple[int, BaseException | None]:
        got = 0
        try:
            async for d in eng.generate(request("long", [1, 2, 3], 4000 // 16), None):
                got += len(d.token_ids)
                if got == 2:
                    await asyncio.to_thread(eng.shutdown)
        except EngineError as e:
            return got, e
        return got, None

    got, err = asyncio.run(main())
    assert got >= 2 and isinstance(err, EngineDeadError)
    with pytest.raises(EngineDeadError):
        asyncio.run(run(eng, request("late", [1, 2, 3]), None))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("nice", [0, 3])
def test_the_served_engine_thread_runs_thread_nice_levels_below_its_process(nice: int) -> None:
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's (the engine thread is started from it)
    if base + nice > 19:
        pytest.skip("this process already runs at the lowest priority")
    eng = AsyncEngine(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=8, thread_nice=nice))
    try:
        asyncio.run(run(eng, request(f"nice-{nice}", [1, 2, 3], 2), None))  # the loop is running by now
        tid = eng._thread.native_id
        assert tid is not None and os.getpriority(os.PRIO_PROCESS, tid) == base + nice
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's thread is untouched
    finally:
        eng.shutdown()


@pytest.mark.parametrize("bad", [-1, 20, True, 2.5])
def test_engine_config_refuses_a_thread_nice_outside_0_to_19(bad: object) -> None:
    with pytest.raises(ValueError, match="thread_nice"):
        EngineConfig(thread_nice=bad)  # type: ignore[arg-type]


def test_stats_read_right_after_a_response_count_that_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot was refreshed when the engine thread next went idle, after the last delta went out, so a
    dashboard or /metrics read right after a response could miss it (here the idle check is made slow)."""
    eng = AsyncEngine(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=64, max_model_len=256,
                                   warmup=False))
    core = eng.core
    has_work = core.has_work

    def slow_when_idle() -> bool:
        busy = has_work()
        if not busy:
            import time
            time.sleep(0.05)
        return busy

    monkeypatch.setattr(core, "has_work", slow_when_idle)

    async def main() -> None:
        for i in range(3):
            before = eng.stats().prompt_tokens_total
            async for _ in eng.generate(request(f"s{i}", [1 + i, 2, 3, 4, 5], max_tokens=2),
                                        StreamBatching(interval_s=0.0)):
                pass
            assert eng.stats().prompt_tokens_total == before + 5

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
