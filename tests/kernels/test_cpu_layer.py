"""The fused CPU decode layer (``cs_decode_layer``): K/V writes + attention in one call must give exactly
what the unfused path gives (index_copy_ into the pool, then ``tpp_decode_torch``), for every activation /
pool dtype pair, strided q/k/v views, a write-row map, splits and threads, and with shared runs (TPP) what
the unfused phase 1 + phase 2 + merge give."""

from __future__ import annotations

import pytest
import torch

from chunkserve.kernels import cpu_kernel
from chunkserve.kernels.cpu_layer import FusedDecodeLayer
from chunkserve.kernels.testing import context_from_paths
from chunkserve.kernels.torch_ops import Workspace
from chunkserve.kernels.tpp_torch import tpp_decode_torch

pytestmark = pytest.mark.skipif(cpu_kernel.load_cpu_kernel() is None, reason="no C++ compiler for the CPU kernel")


def _setup(act: torch.dtype, pool: torch.dtype, b: int, lens: list[int], hkv: int, g: int, d: int, c: int,
           seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = sum(-(-ln // c) for ln in lens) + 1
    k_pool = torch.full((hkv, n, c, d), float("nan"), dtype=pool)
    v_pool = torch.full((hkv, n, c, d), float("nan"), dtype=pool)
    paths, slots, nxt = [], [], 1
    for ln in lens:  # the last token of each row is the one this step writes
        chunks = []
        for start in range(0, ln, c):
            nt = min(c, ln - start)
            k_pool[:, nxt, : nt] = torch.randn(hkv, nt, d, generator=gen).to(pool)
            v_pool[:, nxt, : nt] = torch.randn(hkv, nt, d, generator=gen).to(pool)
            chunks.append((nxt, nt))
            nxt += 1
        last, nt = chunks[-1]
        k_pool[:, last, nt - 1] = float("nan")  # must be overwritten by the step's write
        v_pool[:, last, nt - 1] = float("nan")
        slots.append(last * c + nt - 1)
        paths.append(chunks)
    ctx = context_from_paths(paths, c)
    order = ctx.order.tolist()
    # q, k, v as the model hands them over: views of one [T, Hq + 2 Hkv, D] projection, rows in tree order
    qkv = torch.randn(b, hkv * g + 2 * hkv, d, generator=gen).to(act)
    slots_t = torch.tensor([slots[i] for i in order], dtype=torch.int64)
    return k_pool, v_pool, ctx, qkv, slots_t


def _unfused(q, k, v, k_pool, v_pool, ctx, slots, write_rows, scale):
    hkv, n, c, d = k_pool.shape
    if write_rows is not None:
        k, v = k.index_select(0, write_rows), v.index_select(0, write_rows)
    k_pool.view(hkv, n * c, d).index_copy_(1, slots, k.to(k_pool.dtype).transpose(0, 1))
    v_pool.view(hkv, n * c, d).index_copy_(1, slots, v.to(v_pool.dtype).transpose(0, 1))
    return tpp_decode_torch(q, k_pool, v_pool, ctx, scale, inplace=True)


def _fused_and_unfused(threads, scale, hkv, g, setup):
    """Run ``setup()``'s step both ways on ``threads`` threads: (fused output, unfused output, context), after
    checking that both left the same pools (NaN-free slots equal, the step's writes landed alike)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k_pool, v_pool, ctx, qkv, slots = setup()
        q, k, v = qkv[:, : hkv * g], qkv[:, hkv * g: hkv * g + hkv], qkv[:, hkv * g + hkv:]
        kp2, vp2 = k_pool.clone(), v_pool.clone()
        want = _unfused(q, k, v, kp2, vp2, ctx, slots, None, scale)
        layer = FusedDecodeLayer.build(q, k, v, k_pool, v_pool, ctx, slots, None, scale, Workspace())
        assert layer is not None
        got = layer(q, k, v, k_pool, v_pool)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(k_pool.nan_to_num(7.0), kp2.nan_to_num(7.0))
    assert torch.equal(v_pool.nan_to_num(7.0), vp2.nan_to_num(7.0))
    return got, want, ctx


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("act,pool", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                      (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                      (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("lens,hkv,g", [([5], 3, 3), ([700], 3, 3), ([1, 64, 65, 130, 7], 2, 4), ([300, 9], 1, 1)])
def test_fused_layer_equals_index_copy_then_tpp_decode_bitwise(threads, act, pool, lens, hkv, g):
    """Long single rows take the split (flash-decoding) path with 2 threads; NaN in the written slots and
    in every free slot proves the write lands before the attention reads and nothing else is read."""
    d, c, b = 64, 64, len(lens)
    got, want, ctx = _fused_and_unfused(threads, 0.125, hkv, g,
                                        lambda: _setup(act, pool, b, lens, hkv, g, d, c, seed=len(lens) * 7 + hkv))
    assert got.dtype == act and got.shape == (b, hkv * g, d)
    assert not got.isnan().any()
    assert torch.equal(got, want)


def test_fused_layer_reads_write_rows_through_the_row_map():
    """``write_rows`` picks which source rows land in the slots (here reversed; q is untouched by it)."""
    d, c, hkv, g = 32, 16, 2, 2
    k_pool, v_pool, ctx, qkv, slots = _setup(torch.float32, torch.float32, 3, [20, 3, 40], hkv, g, d, c, seed=3)
    q, k, v = qkv[:, : hkv * g], qkv[:, hkv * g: hkv * g + hkv], qkv[:, hkv * g + hkv:]
    # source rows laid out reversed, with the map undoing it
    k_src, v_src = k.flip(0).contiguous(), v.flip(0).contiguous()
    rows = torch.tensor([2, 1, 0], dtype=torch.int64)
    kp2, vp2 = k_pool.clone(), v_pool.clone()
    want = _unfused(q, k_src, v_src, kp2, vp2, ctx, slots, rows, 0.2)
    layer = FusedDecodeLayer.build(q, k_src, v_src, k_pool, v_pool, ctx, slots, rows, 0.2, Workspace())
    assert layer is not None
    assert torch.equal(layer(q, k_src, v_src, k_pool, v_pool), want)


TREES = {  # chunk ids per row (chunk 0 unused); the last of each row is private, with that many valid tokens
    "one_run": ([[1, 2, 5], [1, 2, 6], [1, 2, 7]], {5: 7, 6: 3, 7: 16}),
    "nested": ([[1, 2, 3, 8], [1, 2, 3, 9], [1, 2, 4, 10], [1, 2, 4, 11], [12]], {8: 5, 9: 9, 10: 1, 11: 12, 12: 4}),
}


def _setup_tree(act: torch.dtype, pool: torch.dtype, tree: str, hkv: int, g: int, d: int, c: int, seed: int):
    rows, last_tokens = TREES[tree]
    gen = torch.Generator().manual_seed(seed)
    n = max(ch for row in rows for ch in row) + 1
    k_pool = torch.full((hkv, n, c, d), float("nan"), dtype=pool)
    v_pool = torch.full((hkv, n, c, d), float("nan"), dtype=pool)
    for ch in range(1, n):
        nt = last_tokens.get(ch, c)
        k_pool[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(pool)
        v_pool[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(pool)
    for ch, nt in last_tokens.items():  # the slot this step writes: NaN until the write
        k_pool[:, ch, nt - 1] = float("nan")
        v_pool[:, ch, nt - 1] = float("nan")
    ctx = context_from_paths([[(ch, last_tokens.get(ch, c)) for ch in row] for row in rows], c)
    order = ctx.order.tolist()
    qkv = torch.randn(len(rows), hkv * g + 2 * hkv, d, generator=gen).to(act)
    slots = torch.tensor([rows[i][-1] * c + last_tokens[rows[i][-1]] - 1 for i in order], dtype=torch.int64)
    return k_pool, v_pool, ctx, qkv, slots


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("act,pool", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                      (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_fused_layer_with_shared_runs_equals_index_copy_then_tpp_decode(threads, act, pool, tree):
    """TPP in one call: phase 1 over the shared runs, the private pass, one merge per row, against the unfused
    path (the same kernels, then ATen's merge); free and to-be-written slots hold NaN."""
    d, c, hkv, g = 32, 16, 2, 3
    got, want, ctx = _fused_and_unfused(threads, 0.17, hkv, g,
                                        lambda: _setup_tree(act, pool, tree, hkv, g, d, c, seed=threads))
    assert ctx.num_runs >= 1
    assert got.dtype == act and not got.isnan().any()
    tol = 1e-6 if act == torch.float32 else 8e-3  # the merge's exp (libm against ATen's) may differ in an ulp
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
