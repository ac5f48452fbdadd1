"""Prefill chunk-first on the CPU (`kernels/prefill_runs.py`): the shared runs it finds, the block runs and
own-chunk tables of its plan, and outputs equal to the row-by-row path and a float64 reference."""

from __future__ import annotations

import pytest
import torch

from chunkserve.kernels.prefill import prefill_attention, prefill_torch
from chunkserve.kernels.prefill_runs import CpuPrefillPlan, causal_runs, find_runs, run_kernel
from tests.kernels.test_prefill import reference

C = 16


def test_adjacent_rows_sharing_full_cached_chunks_form_one_run_limited_by_the_earliest_new_token() -> None:
    tables = [[5, 6, 7, 9], [5, 6, 7, 10], [5, 6, 8, 11], [3, 4, 0, 0], [5, 6, 0, 0]]
    tokens = [[C, C, C, 4], [C, C, C, 9], [C, C, C, 2], [C, 7, 0, 0], [C, 3, 0, 0]]
    starts = [3 * C + 1, 3 * C + 5, 2 * C + 20, C + 2, 5]  # row 2 has new tokens in its third chunk
    cu = [0, 3, 7, 9, 11, 13]
    runs = find_runs(tables, tokens, starts, cu, C)
    assert runs is not None
    # rows 0-2 share chunks 5, 6 (7 is not row 2's); row 3 alone has one full cached chunk; row 4 starts at 5
    assert runs.rows == [(0, 3), (3, 4)] and runs.chunks == [(5, 6), (3,)] and runs.skip == [2, 2, 2, 1, 0]
    assert find_runs([[5, 6]], [[C, 3]], [C - 1], [0, 4], C) is None  # its first chunk is not all cached


def test_the_plan_gives_each_token_its_own_chunk_up_to_its_position_and_a_block_run_over_the_chunks_between(
        ) -> None:
    tables, tokens = [[5, 6, 9, 11]], [[C, C, C, 4]]
    start, n_new = C + 10, 2 * C - 6  # positions C+10 .. 3C+3
    plan = CpuPrefillPlan.build(tables, tokens, [start], [0, n_new], C)
    assert plan.runs is not None and plan.runs.skip == [1]  # chunk 5 is cached before every new token
    pos = torch.arange(start, start + n_new)
    chunk = torch.where(pos < 2 * C, 6, torch.where(pos < 3 * C, 9, 11))
    first = torch.where(pos < 2 * C, C, torch.where(pos < 3 * C, 2 * C, 3 * C))
    assert plan.own_table[:, 0].tolist() == chunk.tolist()
    assert plan.own_seen[:, 0].tolist() == (pos + 1 - first).tolist()
    assert plan.blocks is not None
    assert plan.blocks.rows.tolist() == [[6, 22], [22, 26]]  # the tokens in chunk 9, then those in chunk 11
    assert plan.blocks.chunks.tolist() == [6, 6, 9] and plan.blocks.cptr.tolist() == [0, 1, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_prefill_over_shared_cached_chunks_equals_the_row_by_row_path_and_the_reference(
        cache_tree, check, dtype: torch.dtype, heads: tuple[int, int]) -> None:
    hq, hkv = heads
    tree = cache_tree(7, hkv, 64, C, dtype, device="cpu", max_len=512)
    system = [tree.rint(0, 4) for _ in range(3 * C + 5)]  # 3 full chunks + a partial one, shared
    ids, starts, cu = [], [], [0]
    for n_new in (3, 12, 70, 1, 20):  # short suffixes and one that spans several chunks
        seq = system + [tree.rint(0, 4) for _ in range(n_new + tree.rint(0, 9))]
        ids.append(tree.add(seq))
        starts.append(len(seq) - n_new)
        cu.append(cu[-1] + n_new)
    fresh = [tree.rint(0, 4) for _ in range(3 * C + 7)]  # a last row with nothing cached
    ids.append(tree.add(fresh))
    starts.append(0)
    cu.append(cu[-1] + len(fresh))
    ctx = tree.cache.context(ids)
    inv = torch.argsort(ctx.order)
    table, tokens = ctx.block_table.index_select(0, inv), ctx.block_tokens.index_select(0, inv)
    q = torch.randn(cu[-1], hq, 64, generator=tree.gen).to(dtype)
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]  # NaN in every slot no sequence holds
    if run_kernel(q, pools[0]) is None:
        pytest.skip("the CPU kernel is not available here")
    plan = CpuPrefillPlan.build(table.tolist(), tokens.tolist(), starts, cu, C)
    assert plan.runs is not None and plan.runs.rows == [(0, 5)] and len(plan.runs.chunks[0]) == 3
    assert plan.blocks is not None  # the long rows' later chunks see their earlier ones as a run
    kvs = [tuple(x[0].transpose(0, 1) for x in tree.kv(tree.tokens[s])) for s in ids]
    ref = reference(q, kvs, starts, cu, 0.125)
    chunked = prefill_attention(q, *pools, table, tokens, starts, cu, 0.125, backend="torch")
    rowwise = prefill_torch(q, *pools, table.tolist(), tokens.tolist(), starts, cu, 0.125)
    assert torch.isfinite(chunked).all()
    assert check.rel_err(chunked, ref) < check.tol[dtype]
    assert check.rel_err(chunked, rowwise) < check.tol[dtype]


def _tree_rows(tree, c: int, fresh_len: int):  # type: ignore[no-untyped-def]
    """A shared system prompt with suffixes of several lengths, and a fresh row of ``fresh_len`` tokens."""
    system = [tree.rint(0, 4) for _ in range(3 * c + 5)]
    ids, starts, cu = [], [], [0]
    for n_new in (3, 70, 1, 150):
        seq = system + [tree.rint(0, 4) for _ in range(n_new + tree.rint(0, 9))]
        ids.append(tree.add(seq))
        starts.append(len(seq) - n_new)
        cu.append(cu[-1] + n_new)
    fresh = [tree.rint(0, 4) for _ in range(fresh_len)]
    ids.append(tree.add(fresh))
    starts.append(0)
    cu.append(cu[-1] + fresh_len)
    ctx = tree.cache.context(ids)
    inv = torch.argsort(ctx.order)
    return ids, starts, cu, ctx.block_table.index_select(0, inv), ctx.block_tokens.index_select(0, inv)


@pytest.mark.parametrize("c", [16, 64])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_causal_runs_mask_each_token_at_its_position_and_equal_the_block_and_own_chunk_plan(
        cache_tree, check, c: int, heads: tuple[int, int]) -> None:
    """bf16, d = 64, on AMX tiles or vdpbf16ps pairs: one causal run per piece of a request's tokens over all its
    unshared chunks, pieces of several chunks (a 300-token fresh row: three pieces), a cached prefix ending mid-chunk and
    NaN in every free pool slot, against a float64 reference and the plan with block runs and own chunks."""
    from chunkserve.kernels.prefill_runs import chunk_first_prefill

    hq, hkv = heads
    tree = cache_tree(11, hkv, 64, c, torch.bfloat16, device="cpu", max_len=1024)
    ids, starts, cu, table, tokens = _tree_rows(tree, c, 300)
    q = torch.randn(cu[-1], hq, 64, generator=tree.gen).to(torch.bfloat16)
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]
    kern = run_kernel(q, pools[0])
    if kern is None or not causal_runs(kern, pools[0]):
        pytest.skip("causal runs need AMX tiles or AVX512-BF16 pairs")
    causal = CpuPrefillPlan.build(table.tolist(), tokens.tolist(), starts, cu, c, causal=True)
    blocks = CpuPrefillPlan.build(table.tolist(), tokens.tolist(), starts, cu, c)
    assert causal.causal is not None and causal.blocks is None and blocks.causal is None
    assert causal.causal.rows.shape[0] > len(starts)  # the long rows come in several pieces
    kvs = [tuple(x[0].transpose(0, 1) for x in tree.kv(tree.tokens[s])) for s in ids]
    ref = reference(q, kvs, starts, cu, 0.125)
    got = chunk_first_prefill(kern, q, *pools, causal, 0.125)
    old = chunk_first_prefill(kern, q, *pools, blocks, 0.125)
    assert torch.isfinite(got).all()
    assert check.rel_err(got, ref) < check.tol[torch.bfloat16]
    assert check.rel_err(got, old) < check.tol[torch.bfloat16]


def test_causal_runs_over_an_fp32_pool_equal_the_block_and_own_chunk_plan(cache_tree, check) -> None:
    """The planner gives fp32 pools block runs and own chunks (causal runs gained nothing there), but the kernel masks
    causal runs on every path: over an fp32 pool they give what the block plan gives, against a float64 reference."""
    from chunkserve.kernels.prefill_runs import chunk_first_prefill

    tree = cache_tree(3, 2, 64, C, torch.float32, device="cpu", max_len=256)
    ids, starts, cu, table, tokens = _tree_rows(tree, C, 40)
    q = torch.randn(cu[-1], 4, 64, generator=tree.gen)
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]
    kern = run_kernel(q, pools[0])
    if kern is None:
        pytest.skip("the CPU kernel is not available here")
    assert not causal_runs(kern, pools[0])
    causal = CpuPrefillPlan.build(table.tolist(), tokens.tolist(), starts, cu, C, causal=True)
    blocks = CpuPrefillPlan.build(table.tolist(), tokens.tolist(), starts, cu, C)
    kvs = [tuple(x[0].transpose(0, 1) for x in tree.kv(tree.tokens[s])) for s in ids]
    got = chunk_first_prefill(kern, q, *pools, causal, 0.125)
    assert torch.isfinite(got).all()
    assert check.rel_err(got, reference(q, kvs, starts, cu, 0.125)) < 1e-5
    assert check.rel_err(got, chunk_first_prefill(kern, q, *pools, blocks, 0.125)) < 1e-5
