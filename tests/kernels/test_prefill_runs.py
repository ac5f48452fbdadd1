"""Prefill over shared cached chunks, chunk-first (`kernels/prefill_runs.py`): the runs it finds, the causal
tables of rows with few new tokens, and outputs equal to the row-by-row path and a float64 reference."""

from __future__ import annotations

import pytest
import torch

from chunkserve.kernels.prefill import prefill_attention, prefill_torch
from chunkserve.kernels.prefill_runs import (
    TAIL_MAX_TOKENS,
    CpuPrefillPlan,
    find_runs,
    run_kernel,
    tail_tables,
)
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


def test_a_small_rows_tokens_see_the_chunks_after_the_run_up_to_their_own_position() -> None:
    tables, tokens = [[5, 6, 9, 0]], [[C, C, 3, 0]]
    idx, table, seen = tail_tables([0], tables, tokens, [2 * C + 1], [0, 2], [2])
    assert idx.tolist() == [0, 1] and table.tolist() == [[9], [9]]
    assert seen.tolist() == [[2], [3]]  # positions 2C+1 and 2C+2 see 2 and 3 keys of chunk 9
    idx, table, seen = tail_tables([0], tables, tokens, [C - 2], [0, 3], [0])  # no run: from chunk 0
    assert table.tolist() == [[5, 6]] * 3  # chunk 9 (from 2C on) lies past the row's last new token
    assert seen.tolist() == [[C - 1, 0], [C, 0], [C, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_prefill_over_shared_cached_chunks_equals_the_row_by_row_path_and_the_reference(
        cache_tree, check, dtype: torch.dtype, heads: tuple[int, int]) -> None:
    hq, hkv = heads
    tree = cache_tree(7, hkv, 64, C, dtype, device="cpu", max_len=512)
    system = [tree.rint(0, 4) for _ in range(3 * C + 5)]  # 3 full chunks + a partial one, shared
    ids, starts, cu = [], [], [0]
    for n_new in (3, 12, TAIL_MAX_TOKENS + 6, 1, 20):  # small rows and one long one among them
        seq = system + [tree.rint(0, 4) for _ in range(n_new + tree.rint(0, 9))]
        ids.append(tree.add(seq))
        starts.append(len(seq) - n_new)
        cu.append(cu[-1] + n_new)
    ctx = tree.cache.context(ids)
    inv = torch.argsort(ctx.order)
    table, tokens = ctx.block_table.index_select(0, inv), ctx.block_tokens.index_select(0, inv)
    q = torch.randn(cu[-1], hq, 64, generator=tree.gen).to(dtype)
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]  # NaN in every slot no sequence holds
    if run_kernel(q, pools[0]) is None:
        pytest.skip("the CPU kernel is not available here")
    plan = CpuPrefillPlan.build(table.tolist(), tokens.tolist(), starts, cu, C)
    assert plan.runs is not None and plan.runs.rows == [(0, 5)] and len(plan.runs.chunks[0]) == 3
    assert plan.small == [0, 1, 3, 4]  # the long row goes through the loop, merged into its run's partial
    kvs = [tuple(x[0].transpose(0, 1) for x in tree.kv(tree.tokens[s])) for s in ids]
    ref = reference(q, kvs, starts, cu, 0.125)
    chunked = prefill_attention(q, *pools, table, tokens, starts, cu, 0.125, backend="torch")
    rowwise = prefill_torch(q, *pools, table.tolist(), tokens.tolist(), starts, cu, 0.125, prefix_runs=False)
    assert torch.isfinite(chunked).all()
    assert check.rel_err(chunked, ref) < check.tol[dtype]
    assert check.rel_err(chunked, rowwise) < check.tol[dtype]
