"""Prefill attention over a cached prefix (torch and Triton) against a float64 causal reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.kernels.prefill import prefill_attention
from chunkserve.kernels.testing import random_tree

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
BACKENDS = ["torch", "triton"]


def reference(q: torch.Tensor, kvs: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int],
              cu: list[int], scale: float) -> torch.Tensor:
    """Float64 causal attention per row. kvs[b]: [Hkv, L_b, D] each -> [T, Hq, D]."""
    outs = []
    for b, (k, v) in enumerate(kvs):
        n = cu[b + 1] - cu[b]
        qb = q[cu[b] : cu[b + 1]].cpu().double().transpose(0, 1)  # [Hq, n, D]
        g = qb.shape[0] // k.shape[0]
        end = starts[b] + n
        kk = k.cpu().double().repeat_interleave(g, 0)[:, :end]
        vv = v.cpu().double().repeat_interleave(g, 0)[:, :end]
        mask = torch.arange(end)[None, :] <= (torch.arange(n) + starts[b])[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(qb, kk, vv, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 3), heads=st.sampled_from([(9, 3), (4, 1), (2, 2)]),
       dtype=st.sampled_from([torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])))
def test_prefill_over_cached_prefix_matches_reference(cache_tree, check, seed, rows, heads, dtype):
    hq, hkv = heads
    tree = cache_tree(seed, hkv, 64, 16, dtype, device=DEV)
    prefix = [tree.rint(0, 4) for _ in range(tree.rint(0, 40))]
    ids, starts, cu = [], [], [0]
    for _ in range(rows):
        new = [tree.rint(0, 4) for _ in range(tree.rint(1, 20))]
        cached = tree.cache.match(prefix + new)
        ids.append(tree.add(prefix + new))
        starts.append(max(cached, len(prefix)) if tree.rint(0, 1) else len(prefix))
        cu.append(cu[-1] + len(prefix) + len(new) - starts[-1])
    ctx = tree.cache.context(ids)
    inv = torch.argsort(ctx.order).to(ctx.block_table.device)
    table, tokens = ctx.block_table.index_select(0, inv), ctx.block_tokens.index_select(0, inv)
    q = torch.randn(cu[-1], hq, 64, generator=tree.gen).to(dtype).to(DEV)
    kvs = [tuple(x[0].transpose(0, 1) for x in tree.kv(tree.tokens[s])) for s in ids]
    ref = reference(q, kvs, starts, cu, 0.125)
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]
    for backend in BACKENDS:
        o = prefill_attention(q, *pools, table, tokens, starts, cu, 0.125, backend=backend)
        err = check.rel_err(o, ref)
        assert err < check.tol[dtype], (backend, err)


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_with_partial_middle_chunks_and_gqa(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen, 3, 2, 64, 16, branch=0.0)
    paths = tree.paths
    width = max(len(p) for p in paths)
    table = torch.tensor([[c for c, _ in p] + [0] * (width - len(p)) for p in paths], dtype=torch.int32)
    tokens = torch.tensor([[t for _, t in p] + [0] * (width - len(p)) for p in paths], dtype=torch.int32)
    totals = tokens.sum(1).tolist()
    ns = [min(t, 1 + seed * 7) for t in totals]
    starts = [t - n for t, n in zip(totals, ns, strict=True)]
    cu = [0]
    for n in ns:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], 6, 64, generator=gen)
    ref = reference(q, [tree.gather(s) for s in range(len(paths))], starts, cu, 0.125)
    for backend in BACKENDS:
        o = prefill_attention(q.to(DEV), tree.k_pool[0].to(DEV), tree.v_pool[0].to(DEV), table.to(DEV),
                              tokens.to(DEV), starts, cu, 0.125, backend=backend)
        assert float((o.cpu().double() - ref).norm() / ref.norm()) < 1e-5, backend


def test_prefill_bf16_torch(cache_tree, check):
    tree = cache_tree(4, 2, 64, 16, torch.bfloat16, device="cpu")
    s = tree.add(list(range(5)) * 9)
    ctx = tree.cache.context([s])
    q = torch.randn(10, 4, 64).bfloat16()
    kv = [tuple(x[0].transpose(0, 1) for x in tree.kv(tree.tokens[s]))]
    o = prefill_attention(q, tree.cache.k_pool[0], tree.cache.v_pool[0], ctx.block_table, ctx.block_tokens,
                          [35], [0, 10], backend="torch")
    assert check.rel_err(o, reference(q, kv, [35], [0, 10], 0.125)) < 2e-3


def test_prefill_rejects_bad_input(cache_tree):
    tree = cache_tree(4, 2, 64, 16, torch.float32, device="cpu")
    s = tree.add(list(range(20)))
    ctx = tree.cache.context([s])
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]
    q = torch.randn(5, 4, 64)
    with pytest.raises(ValueError, match="backend"):
        prefill_attention(q, *pools, ctx.block_table, ctx.block_tokens, [15], [0, 5], backend="flash")
    with pytest.raises(ValueError, match="hold"):
        prefill_attention(q, *pools, ctx.block_table, ctx.block_tokens, [16], [0, 5])
    with pytest.raises(ValueError, match="cu_q"):
        prefill_attention(q, *pools, ctx.block_table, ctx.block_tokens, [15], [0, 4])
    with pytest.raises(ValueError, match="dtype"):
        prefill_attention(q.double(), *pools, ctx.block_table, ctx.block_tokens, [15], [0, 5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_without_cached_prefix_is_plain_causal(cache_tree, check, dtype):
    tree = cache_tree(6, 3, 64, 16, dtype, device=DEV)
    a, b = tree.add([1, 2, 3, 4] * 9), tree.add([4, 3] * 5)
    ctx = tree.cache.context([a, b])
    inv = torch.argsort(ctx.order).to(ctx.block_table.device)
    table, tokens = ctx.block_table.index_select(0, inv), ctx.block_tokens.index_select(0, inv)
    cu = [0, 36, 46]
    q = torch.randn(46, 9, 64, generator=tree.gen).to(dtype).to(DEV)
    kvs = [tuple(x[0].transpose(0, 1) for x in tree.kv(tree.tokens[s])) for s in (a, b)]
    ref = reference(q, kvs, [0, 0], cu, 0.125)
    pools = tree.cache.k_pool[0], tree.cache.v_pool[0]
    for backend in BACKENDS:
        o = prefill_attention(q, *pools, table, tokens, [0, 0], cu, 0.125, backend=backend)
        assert check.rel_err(o, ref) < check.tol[dtype], backend
