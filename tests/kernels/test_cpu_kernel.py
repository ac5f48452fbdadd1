"""The in-place CPU decode kernel: against float64 references and the gather path, its splits, its
poisoned-pool safety, its fallbacks and its build cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.kernels import chunk_attention, cpu_kernel
from chunkserve.kernels.paged_torch import paged_decode_torch
from chunkserve.kernels.testing import ChunkTree, sdpa_reference
from chunkserve.kernels.torch_ops import Workspace
from chunkserve.kernels.tpp_torch import tpp_decode_torch

pytestmark = pytest.mark.skipif(cpu_kernel.load_cpu_kernel() is None, reason="no C++ compiler for the CPU kernel")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _decode(fn, q: torch.Tensor, cache, ids: list[int], inplace: bool) -> torch.Tensor:
    """Run a torch backend on caller-ordered q; returns caller-ordered output."""
    ctx = cache.context(ids)
    order = ctx.order.to(torch.int64)
    o_sorted = fn(q.index_select(0, order), cache.k_pool[0], cache.v_pool[0], ctx, q.shape[-1] ** -0.5,
                  workspace=Workspace(), inplace=inplace)
    o = torch.empty_like(o_sorted)
    o.index_copy_(0, order, o_sorted)
    return o


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), num_seqs=st.integers(1, 7),
       heads=st.sampled_from([(1, 1), (4, 1), (9, 3), (32, 8), (4, 4)]), d=st.sampled_from([64, 80, 128]),
       c=st.sampled_from([16, 64]), dtype=st.sampled_from(DTYPES))
def test_inplace_and_gather_paths_both_match_the_float64_reference(cache_tree, check, seed, num_seqs, heads, d, c,
                                                                   dtype):
    hq, hkv = heads
    tree = cache_tree(seed, hkv, d, c, dtype, device="cpu", num_chunks=512)
    ids = tree.grow(num_seqs, max_len=4 * c)
    q = torch.randn(len(ids), hq, d, generator=tree.gen).to(dtype)
    ref = tree.reference(q, ids, d**-0.5)
    outs = {}
    for fn in (tpp_decode_torch, paged_decode_torch):
        for inplace in (True, False):
            o = _decode(fn, q, tree.cache, ids, inplace)
            assert o.dtype == dtype
            assert check.rel_err(o, ref) < check.tol[dtype], (fn.__name__, inplace, check.rel_err(o, ref))
            outs[(fn.__name__, inplace)] = o
    # the two TPP paths compute the same thing up to summation order
    assert check.rel_err(outs[("tpp_decode_torch", True)], outs[("tpp_decode_torch", False)].double()) \
        < check.tol[dtype]


@pytest.mark.parametrize("d", [8, 24, 36, 40, 72, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_that_are_not_a_multiple_of_the_vector_width_attend_exactly(cache_tree, check, d, dtype):
    """The kernel works in whole vectors (8 or 16 lanes): such head dims must not reach it (they read past the
    head and gave errors of order 1), shared runs included."""
    tree = cache_tree(d, 2, d, 16, dtype, device="cpu", num_chunks=256)
    ids = tree.grow(5, max_len=64)
    q = torch.randn(len(ids), 4, d, generator=tree.gen).to(dtype)
    ref = tree.reference(q, ids, d**-0.5)
    for backend in ("torch", "paged-torch"):
        o = chunk_attention(q, tree.cache, ids, backend=backend)
        assert check.rel_err(o, ref) < check.tol[dtype], (backend, check.rel_err(o, ref))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_are_split_across_threads_and_merged_exactly(check, threads, dtype):
    """b * Hkv < 4 threads: every row is split into several key ranges, merged by log-sum-exp."""
    gen = torch.Generator().manual_seed(0)
    hkv, g, d, c, n_chunks = 2, 3, 64, 16, 40
    k_pool = torch.full((hkv, 48, c, d), float("nan"), dtype=dtype)
    v_pool = torch.full((hkv, 48, c, d), float("nan"), dtype=dtype)
    ids = torch.randperm(48, generator=gen)[:n_chunks]
    tokens = torch.full((1, n_chunks), c, dtype=torch.int32)
    tokens[0, -1] = 5  # a partly filled last chunk: slots 5.. hold NaN and must not be read
    for p, ch in enumerate(ids.tolist()):
        nt = int(tokens[0, p])
        k_pool[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(dtype)
        v_pool[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(dtype)
    keys = torch.cat([k_pool[:, ch, : int(tokens[0, p])] for p, ch in enumerate(ids.tolist())], 1)  # [Hkv, T, D]
    vals = torch.cat([v_pool[:, ch, : int(tokens[0, p])] for p, ch in enumerate(ids.tolist())], 1)
    q = torch.randn(1, hkv, g, d, generator=gen)
    ref = sdpa_reference(q[0].reshape(hkv * g, d), keys, vals, d**-0.5)  # [Hq, D] float64
    o = torch.empty(1, hkv, g, d)
    lse = torch.empty(1, hkv, g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ws = Workspace()
        cpu_kernel.load_cpu_kernel()(q, k_pool, v_pool, ids.view(1, -1).to(torch.int32), tokens, d**-0.5, o, lse, ws)
        assert "cpuk_so" in ws._bufs  # the split scratch was used: the rows really were split
    finally:
        torch.set_num_threads(old)
    assert check.rel_err(o.reshape(hkv * g, d), ref) < 1e-5
    s = (q[0].double() @ keys.double().transpose(-1, -2)) * d**-0.5  # [Hkv, g, T]
    assert torch.allclose(lse[0].double(), torch.logsumexp(s, -1), atol=1e-4)


def test_rows_without_keys_and_zero_token_positions_give_zero_and_minus_inf():
    gen = torch.Generator().manual_seed(1)
    k_pool = torch.full((1, 6, 16, 64), float("nan"))
    v_pool = torch.full((1, 6, 16, 64), float("nan"))
    k_pool[:, 2, :3] = torch.randn(1, 3, 64, generator=gen)
    v_pool[:, 2, :3] = torch.randn(1, 3, 64, generator=gen)
    table = torch.tensor([[4, 2, 5], [0, 0, 0]], dtype=torch.int32)
    tokens = torch.tensor([[0, 3, 0], [0, 0, 0]], dtype=torch.int32)  # chunks 4, 5 are all NaN: skipped
    q = torch.randn(2, 1, 2, 64, generator=gen)
    o, lse = torch.empty(2, 1, 2, 64), torch.empty(2, 1, 2)
    cpu_kernel.load_cpu_kernel()(q, k_pool, v_pool, table, tokens, 0.125, o, lse, Workspace())
    ref = sdpa_reference(q[0, 0], k_pool[:, 2, :3], v_pool[:, 2, :3], 0.125)
    assert torch.allclose(o[0, 0].double(), ref.reshape(2, 64), atol=1e-6)
    assert torch.equal(o[1], torch.zeros(1, 2, 64))
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()


def test_unsupported_group_size_falls_back_to_the_gather_path_and_inplace_true_refuses():
    gen = torch.Generator().manual_seed(2)
    k_pool = torch.randn(1, 1, 4, 16, 8, generator=gen)
    v_pool = torch.randn(1, 1, 4, 16, 8, generator=gen)
    tree = ChunkTree(k_pool, v_pool, [[(0, 16), (1, 3)], [(2, 9)]], 16)
    q = torch.randn(2, 40, 8, generator=gen)  # 40 query heads on one KV head: beyond the kernel's tile
    ctx = tree.context([0, 1])
    ref = torch.stack([sdpa_reference(q[i], *tree.gather(i), 8**-0.5) for i in range(2)])
    q_sorted = q.index_select(0, ctx.order.to(torch.int64))
    o = tpp_decode_torch(q_sorted, k_pool[0], v_pool[0], ctx, 8**-0.5)
    o_caller = torch.empty_like(o).index_copy_(0, ctx.order.to(torch.int64), o)
    assert float((o_caller.double() - ref).norm() / ref.norm()) < 1e-5
    with pytest.raises(RuntimeError, match="does not support"):
        tpp_decode_torch(q_sorted, k_pool[0], v_pool[0], ctx, 8**-0.5, inplace=True)


def test_build_is_cached_and_keyed_by_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKSERVE_CACHE", str(tmp_path))
    first = cpu_kernel.build()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernel.build() == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    monkeypatch.setattr(cpu_kernel, "_cpu_signature", lambda: "model name: another CPU\nflags: sse2")
    other = cpu_kernel.build()
    assert other != first and other.exists()  # another CPU model never loads this machine's build


def test_env_switch_disables_the_kernel(monkeypatch):
    monkeypatch.setenv("CHUNKSERVE_CPU_KERNEL", "0")
    cpu_kernel.load_cpu_kernel.cache_clear()
    try:
        assert cpu_kernel.load_cpu_kernel() is None
        q4, pool = torch.zeros(1, 1, 1, 8), torch.zeros(1, 2, 16, 8)
        assert cpu_kernel.inplace_kernel(q4, pool, None) is None
    finally:
        monkeypatch.delenv("CHUNKSERVE_CPU_KERNEL")
        cpu_kernel.load_cpu_kernel.cache_clear()
    assert cpu_kernel.load_cpu_kernel() is not None
