"""Triton TPP / paged kernels (the interpreter on CPUs, CUDA when present) against float64 and torch."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.kernels import chunk_attention, decode_attention
from chunkserve.kernels.testing import random_tree, sdpa_reference
from chunkserve.kernels.torch_ops import Workspace

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1 before import", allow_module_level=True)

from chunkserve.kernels.paged_triton import paged_decode_triton  # noqa: E402
from chunkserve.kernels.tpp_triton import max_private_chunks, pick_kv_split, tpp_decode_triton  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
EXAMPLES = 15


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), num_seqs=st.integers(1, 5), heads=st.sampled_from([(9, 3), (4, 1), (2, 2)]),
       d=st.sampled_from([64, 128]), dtype=st.sampled_from(DTYPES))
def test_triton_matches_float64_reference_on_cache_trees(cache_tree, check, seed, num_seqs, heads, d, dtype):
    hq, hkv = heads
    tree = cache_tree(seed, hkv, d, 16, dtype, device=DEV)
    ids = tree.grow(num_seqs, max_len=40, decode_steps=1)
    q = (torch.randn(len(ids), hq, d, generator=tree.gen)).to(dtype).to(DEV)
    ref = tree.reference(q, ids, d**-0.5)
    for backend in ("triton", "paged-triton"):
        o = chunk_attention(q, tree.cache, ids, backend=backend)
        assert o.shape == q.shape and o.dtype == dtype
        err = check.rel_err(o, ref)
        assert err < check.tol[dtype], (backend, err)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_triton_on_partial_middle_chunks_scattered_over_nan_pool(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen, 5, 2, 64, 16, branch=0.2, max_depth=3)
    tree.k_pool, tree.v_pool = tree.k_pool.to(DEV), tree.v_pool.to(DEV)
    ids = torch.randperm(len(tree.paths), generator=gen).tolist()
    q = torch.randn(len(ids), 6, 64, generator=gen)
    ref = torch.stack([sdpa_reference(q[i], *[x.cpu() for x in tree.gather(s)], 0.125) for i, s in enumerate(ids)])
    for backend in ("triton", "paged-triton"):
        o = chunk_attention(q.to(DEV), tree, ids, backend=backend).cpu()
        assert torch.isfinite(o).all()
        assert float((o.double() - ref).norm() / ref.norm()) < 1e-5


def test_torch_triton_and_paged_agree_on_the_same_tree(cache_tree, check):
    tree = cache_tree(21, 2, 64, 32, torch.float32, device=DEV)
    ids = tree.grow(6, max_len=70, decode_steps=2)
    q = torch.randn(len(ids), 4, 64, generator=tree.gen).to(DEV)
    outs = {b: chunk_attention(q, tree.cache, ids, backend=b) for b in ("torch", "triton", "paged-torch", "paged-triton")}
    base = outs["torch"].double().cpu()
    for name, o in outs.items():
        assert check.rel_err(o, base) < 1e-5, name


@pytest.mark.parametrize("n_split", [2, 3])
def test_phase1_split_partials_merge_exactly(cache_tree, check, n_split):
    tree = cache_tree(5, 1, 64, 16, torch.float32, device=DEV)
    base = [1, 2, 3, 4] * 20  # 80 tokens = 5 chunks shared by every row
    ids = [tree.add(base + [t]) for t in range(3)]
    ctx = tree.cache.context(ids)
    q = torch.randn(3, 2, 64, generator=tree.gen).to(DEV)
    q_sorted = q.index_select(0, ctx.order.to(DEV))
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]
    o = tpp_decode_triton(q_sorted, *pools, ctx, 0.125, n_split=n_split)
    ref = tree.reference(q_sorted.cpu(), [ids[i] for i in ctx.order.tolist()], 0.125)
    assert check.rel_err(o, ref) < 1e-5


@pytest.mark.parametrize("kv_split", [2, 3, 7])
def test_phase2_kv_split_segments_merge_to_the_unsplit_result(cache_tree, check, kv_split):
    """Flash-decoding: each row's private chunks cut into kv_split segments (some empty, one row has
    none) whose partials the reduce kernel merges with the phase-1 run partials; NaN pool."""
    tree = cache_tree(13, 2, 64, 16, torch.float32, device=DEV)
    base = [1, 2, 3, 4] * 12  # 48 tokens: 3 chunks shared by every row
    ids = [tree.add(base + [tree.rint(0, 4) for _ in range(n)]) for n in (0, 5, 37, 120)]
    ctx = tree.cache.context(ids)
    private = (ctx.seq_chunk_ptr[1:] - ctx.seq_chunk_ptr[:-1]).cpu()
    assert ctx.num_runs > 0 and int(private.min()) == 0 and int(private.max()) > kv_split
    q = torch.randn(len(ids), 4, 64, generator=tree.gen).to(DEV)
    q_sorted = q.index_select(0, ctx.order.to(DEV))
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]
    ref = tree.reference(q_sorted.cpu(), [ids[i] for i in ctx.order.tolist()], 0.125)
    outs = {"tpp": tpp_decode_triton(q_sorted, *pools, ctx, 0.125, kv_split=kv_split),
            "tpp+phase1 split": tpp_decode_triton(q_sorted, *pools, ctx, 0.125, n_split=2, kv_split=kv_split),
            "paged": paged_decode_triton(q_sorted, *pools, ctx, 0.125, kv_split=kv_split)}
    for name, o in outs.items():
        assert check.rel_err(o, ref) < 1e-5, name


def test_kv_split_is_chosen_only_when_rows_x_heads_underfill_the_gpu():
    sms = 132
    assert pick_kv_split(8 * 8, 64, 64, sms) == 3  # 64 programs: three segments give each SM one
    assert pick_kv_split(32 * 8, 64, 64, sms) == 1  # 256 programs already fill the GPU
    assert pick_kv_split(2 * 8, 64, 64, sms) == 8  # longest row 4,096 tokens: eight 512-slot segments
    assert pick_kv_split(8 * 8, 12, 64, sms) == 1  # 768 tokens: one 512-slot segment at most
    assert pick_kv_split(8 * 8, 64, 16, sms) == 2  # 1024 tokens of c=16: two segments of 512
    assert pick_kv_split(1, 10_000, 64, sms) == 64  # capped
    assert pick_kv_split(8, 64, 64, 0) == 1  # no GPU


def test_private_chunk_bound_covers_every_row(cache_tree):
    tree = cache_tree(17, 1, 64, 16, torch.float32, device=DEV)
    ids = tree.grow(8, max_len=90, decode_steps=2)
    ctx = tree.cache.context(ids)
    counts = (ctx.seq_chunk_ptr[1:] - ctx.seq_chunk_ptr[:-1]).cpu()
    assert int(counts.max()) <= max_private_chunks(ctx) <= ctx.block_table.shape[1]
    ws = Workspace()
    assert max_private_chunks(ctx, ws) == max_private_chunks(ctx) == max_private_chunks(ctx, ws)


def test_triton_head_dim_80_and_chunk_64(cache_tree, check):
    tree = cache_tree(8, 2, 80, 64, torch.float32, device=DEV)
    ids = tree.grow(3, max_len=100, decode_steps=1)
    q = torch.randn(len(ids), 4, 80, generator=tree.gen).to(DEV)
    ref = tree.reference(q, ids, 80**-0.5)
    for backend in ("triton", "paged-triton"):
        assert check.rel_err(chunk_attention(q, tree.cache, ids, backend=backend), ref) < 1e-5


def test_triton_outputs_are_deterministic(cache_tree):
    tree = cache_tree(9, 2, 64, 16, torch.float16, device=DEV)
    ids = tree.grow(4, max_len=40, decode_steps=1)
    ctx = tree.cache.context(ids)
    q = torch.randn(len(ids), 4, 64).half().to(DEV)
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]
    o1 = decode_attention(q, *pools, ctx, backend="triton")
    o2 = decode_attention(q, *pools, ctx, backend="triton")
    assert torch.equal(o1, o2)
    s1 = tpp_decode_triton(q, *pools, ctx, 0.125, kv_split=3)
    s2 = tpp_decode_triton(q, *pools, ctx, 0.125, kv_split=3)
    assert torch.equal(s1, s2)


@pytest.mark.skipif(ON_GPU, reason="the interpreter-only restriction")
def test_bf16_in_the_interpreter_is_rejected_clearly(cache_tree):
    tree = cache_tree(1, 1, 64, 16, torch.bfloat16, device="cpu")
    s = tree.add([1, 2, 3])
    with pytest.raises(ValueError, match="bf16"):
        chunk_attention(torch.randn(1, 1, 64).bfloat16(), tree.cache, [s], backend="triton")


@pytest.mark.parametrize("c", [128, 256])
def test_triton_large_chunks(cache_tree, check, c):
    tree = cache_tree(c, 1, 64, c, torch.float32, num_chunks=16, device=DEV)
    ids = tree.grow(3, max_len=c + 40, decode_steps=1, scatter=False)
    q = torch.randn(len(ids), 2, 64, generator=tree.gen).to(DEV)
    ref = tree.reference(q, ids, 0.125)
    for backend in ("triton", "paged-triton"):
        assert check.rel_err(chunk_attention(q, tree.cache, ids, backend=backend), ref) < 1e-5


def test_triton_large_logits_do_not_overflow(cache_tree, check):
    tree = cache_tree(3, 2, 64, 16, torch.float16, magnitude=30.0, device=DEV)
    ids = tree.grow(4, max_len=40, decode_steps=1)
    q = (torch.randn(len(ids), 4, 64, generator=tree.gen) * 30.0).half().to(DEV)
    ref = tree.reference(q, ids, 0.125)
    for backend in ("triton", "paged-triton"):
        o = chunk_attention(q, tree.cache, ids, backend=backend)
        assert torch.isfinite(o).all() and check.rel_err(o, ref) < 2e-3
