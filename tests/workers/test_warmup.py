"""Warm-up at start-up (issue 13): the kernels a first request needs are built before the engine is ready.

CPU: the warm-up builds/loads the C++ decode kernel and runs real steps on a scratch cache, so a first
request compiles nothing and the engine's own cache, events and counters are untouched. GPU (proven on
the meta device with the Triton launches recorded, see `sync_probe`): every kernel variant that real
requests of varied shapes select (prefill widths, shared rows, long private rows with key splits) was
already launched by the warm-up.
"""

from __future__ import annotations

import torch

from chunkserve.kernels.cpu_kernel import load_cpu_kernel
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.warmup import compile_count, scratch_steps, triton_variants
from tests.workers.sync_probe import probe, stub_triton
from tests.workers.test_step_sync import CHUNK, META, meta_engine


def run_all(eng: EngineCore) -> None:
    while eng.has_work():
        eng.step()


def test_after_warm_up_a_first_request_builds_nothing_and_the_cache_is_untouched() -> None:
    load_cpu_kernel.cache_clear()  # as in a fresh worker process
    eng = EngineCore(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=32, dtype="float32"))
    assert eng.warmup_stats["compiled"] >= 1  # the CPU kernel was built or loaded by the warm-up
    st = eng.stats()
    assert st["kv_chunks_used"] == 0 and st["kv_chunks_cached"] == 0 and st["num_steps"] == 0
    assert eng.cache.drain_events() == []
    built = compile_count()
    eng.add_request("a", list(range(3, 3 + 2 * CHUNK + 5)), SamplingParams(max_tokens=3, temperature=0.0))
    run_all(eng)
    assert compile_count() == built


def test_without_warm_up_the_first_request_is_what_builds_the_kernel() -> None:
    """The check above can fail: the same request on an engine without warm-up builds the kernel."""
    load_cpu_kernel.cache_clear()
    eng = EngineCore(EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=32, dtype="float32",
                                  warmup=False))
    built = compile_count()
    eng.add_request("a", list(range(3, 3 + 2 * CHUNK + 5)), SamplingParams(max_tokens=3, temperature=0.0))
    run_all(eng)
    assert compile_count() == built + 1


def test_warm_up_launches_every_triton_variant_that_requests_of_any_shape_select() -> None:
    eng = meta_engine(torch.bfloat16, num_kv_chunks=256)
    with stub_triton(META) as launches, probe():  # probe: the meta device's reads return zeros
        scratch_steps(eng)
        triton_variants(eng)
        warmed = {launch.key for launch in launches}
        launches.clear()
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        shared = list(range(3, 3 + 2 * CHUNK))
        batches = [
            [shared + [50 + i] for i in range(2)],  # two rows share a run
            [shared + [60 + i] * 3 for i in range(9)],  # 9 rows x 4 heads: the 64-row phase-1 tile
            [[7] * 1100],  # one long private row: a key split (flash-decoding) and a wide prefill table
            [[8] * 300, [9] * 40],  # no sharing, uneven prefill rows
        ]
        for b, prompts in enumerate(batches):
            for i, p in enumerate(prompts):
                eng.add_request(f"b{b}-{i}", p, greedy)
            run_all(eng)
        met = {launch.key for launch in launches}
    kernels = {k[0] for k in met}
    assert kernels == {"_prefill_kernel", "_tpp_phase1", "_tpp_phase2", "_tpp_reduce"}
    assert any(("SPLIT_KV", True) in k for k in met)
    missing = met - warmed
    assert not missing, f"variants compiled on a first request: {sorted(missing)}"
