"""Engine warm-up: compile and load what serving will meet before the engine reports ready.

1. A real model step on a scratch cache (never the engine's: no cached chunk, no event, no stats):
   a prefill of three prompts, two of them sharing a chunk, then a decode step. On the CPU this
   builds or loads the C++ decode kernel (`kernels/cpu_kernel.py`) and creates oneDNN's primitives;
   on a GPU it compiles the kernels of that path.
2. On a GPU with the Triton backends, every other variant a request can select. The values that
   change from step to step (``n_split``, ``num_partials``, ``kv_split``, ``width``) are
   ``do_not_specialize`` in the kernels, so what remains is a short list of constexpr buckets:
   phase 1 and prefill at the 16- and 64-row tiles (`rows_config`), phase 2 with and without shared
   runs and key splits, the split reduce, and prefill's ``BLOCK_W`` (16 ... 256 chunks per row) up to
   the longest row ``max_model_len`` allows. Each is launched once on a one-layer scratch pool.

`compile_count()` is the hook the tests and `benchmarks/gpu_check.py` read: Triton variants compiled
in this process plus builds/loads of the CPU kernel.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from chunkserve.kernels.api import resolve_backend
from chunkserve.kernels.prefill import PrefillTables, prefill_step
from chunkserve.workers.kvcache import PrefixKVCache
from chunkserve.workers.runner import ModelRunner
from chunkserve.workers.sampler import Sampler
from chunkserve.workers.sampling import SamplingParams
from chunkserve.workers.scheduler import Request, Scheduler, SchedulerConfig
from chunkserve.workers.staging import Staging

if TYPE_CHECKING:
    from chunkserve.workers.engine import EngineCore

ROW_TILE = 16  # rows of the small tile (triton_common.SMALL_ROWS); more rows select the 64-row tile


def compile_count() -> int:
    """Kernel builds in this process: compiled Triton variants of our kernels + CPU-kernel loads."""
    from chunkserve.kernels.cpu_kernel import load_cpu_kernel

    total = load_cpu_kernel.cache_info().misses
    try:
        from chunkserve.kernels import prefill_triton, tpp_triton
    except ImportError:  # no triton
        return total
    for fn in (tpp_triton._tpp_phase1, tpp_triton._tpp_phase2, tpp_triton._tpp_reduce, prefill_triton._prefill_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            total += len(cache[0])
    return total


def warm_up(core: EngineCore) -> dict[str, float]:
    """Run the warm-up on ``core``; returns {"seconds": ..., "compiled": kernels built meanwhile}."""
    t0 = time.perf_counter()
    before = compile_count()
    scratch_steps(core)
    dev = core.cache.pool.device
    if dev.type == "cuda":
        triton_variants(core)
        torch.cuda.synchronize(dev)
    return {"seconds": time.perf_counter() - t0, "compiled": float(compile_count() - before)}


def scratch_steps(core: EngineCore, max_tokens: int = 2) -> int:
    """Prefill + decode steps of the engine's model on a scratch cache; returns the steps run."""
    mc, cfg = core.model_config, core.config
    c = cfg.chunk_size
    cache = PrefixKVCache(mc.num_layers, mc.num_kv_heads, mc.head_dim, c, 8 + 2 * -(-(c + 8) // c) * 3,
                          core.model.dtype, core.cache.pool.device, share_prefix=True)
    sched = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=max(64, 3 * (c + 4)), max_num_seqs=4,
                                             max_model_len=core.max_model_len))
    runner = ModelRunner(core.model, cache, cfg.attention_backend, cfg.prefill_backend)
    sampler = Sampler(0)
    vocab = mc.vocab_size
    runner.sample_stager = lambda st, reqs: sampler.stage(st, [r.request_id for r in reqs],
                                                          [r.params for r in reqs], vocab)
    shared = [(7 * i + 3) % vocab for i in range(c)]
    prompts = [shared + [1 % vocab, 2 % vocab], shared + [3 % vocab], [(5 + i) % vocab for i in range(3)]]
    room = max(1, core.max_model_len - max_tokens)  # a context shorter than a chunk: the prompts fit in it
    prompts = [p[:room] for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add(Request(f"warmup-{i}", p, params))
    steps = 0
    while sched.has_work() and steps < 4 * max_tokens:
        cache.begin_step()
        try:
            plan = sched.schedule()
            logits, reqs = runner.run(plan)
        finally:
            cache.end_step()
        steps += 1
        if not reqs:
            continue
        tokens, _ = sampler.sample(logits, [r.request_id for r in reqs], [r.params for r in reqs],
                                   runner.sample_job)
        for req, tok in zip(reqs, tokens, strict=True):
            req.output.append(tok)
            if len(req.output) >= max_tokens:
                sched.finish(req, "length")
    return steps


def triton_variants(core: EngineCore) -> None:
    """Launch each Triton variant a request can select (see the module docstring) once."""
    from chunkserve.kernels.tpp_triton import tpp_decode_triton

    mc, c = core.model_config, core.config.chunk_size
    dev, dtype = core.cache.pool.device, core.model.dtype
    hkv, d, hq = mc.num_kv_heads, mc.head_dim, mc.num_heads
    g = hq // hkv
    big = max(2, -(-(ROW_TILE + 1) // g))  # sequences whose packed rows exceed the small tile
    cache = PrefixKVCache(1, hkv, d, c, 4 * big + 8, dtype, dev, share_prefix=True)
    kv = lambda n: torch.zeros(1, n, hkv, d, dtype=dtype, device=dev)  # noqa: E731
    shared = list(range(c))
    pair = [cache.add_sequence(shared + [100 + i], kv(c + 1), kv(c + 1)) for i in range(2)]
    many = [cache.add_sequence(shared + [200 + i], kv(c + 1), kv(c + 1)) for i in range(big)]
    alone = [cache.add_sequence([300, 301], kv(2), kv(2))]
    kp, vp = cache.k_pool[0], cache.v_pool[0]
    scale = d ** -0.5
    if resolve_backend(core.config.attention_backend, dev) in ("triton", "paged-triton"):
        for ids in (pair, many, alone):
            ctx = cache.context(ids)
            q = torch.zeros(len(ids), hq, d, dtype=dtype, device=dev)
            for kv_split in (1, 2):
                tpp_decode_triton(q, kp, vp, ctx, scale, kv_split=kv_split)
    if core.config.prefill_backend == "triton" or (core.config.prefill_backend == "auto" and dev.type == "cuda"):
        max_width = -(-core.max_model_len // c)
        widths = [w for w in (1, 17, 33, 65, 129) if w <= max_width]
        for n_tok in sorted({1, max(1, min(c * max_width, -(-(ROW_TILE + 1) // g)))}):
            for w in widths:
                if n_tok <= w * c:
                    _prefill_once(kp, vp, n_tok, w, c, scale, hq)


def _prefill_once(kp: torch.Tensor, vp: torch.Tensor, n_tok: int, width: int, c: int, scale: float,
                  hq: int) -> None:
    """One prefill launch: a row of ``n_tok`` new tokens over a table ``width`` chunks wide (chunk 0)."""
    table = np.zeros((1, width), dtype=np.int32)
    tokens = np.zeros((1, width), dtype=np.int32)
    left = n_tok
    for j in range(width):
        tokens[0, j] = min(c, left)
        left -= tokens[0, j]
    tokens[0, 0] = max(tokens[0, 0], 1)
    starts, cu = [0], [0, n_tok]
    arrays = PrefillTables.host_arrays(table, tokens, starts, cu)
    staging = Staging(kp.device, reuse=False)
    idx = {k: staging.add(a, a.dtype.type) for k, a in arrays.items()}
    tensors = staging.flush()
    tables = PrefillTables(table, tokens, starts, cu, **{k: tensors[i] for k, i in idx.items()})
    q = torch.zeros(n_tok, hq, kp.shape[-1], dtype=kp.dtype, device=kp.device)
    prefill_step(q, kp, vp, tables, scale, "triton")
