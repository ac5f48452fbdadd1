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


@pytest.mark.parametrize(("name", "ids", "toks", "start"), [
    # cached chunks 0-1 (24 tokens), the 40 new tokens in consecutive chunks 2-4: one square causal call
    ("new tokens one view after a cut", [0, 1, 2, 3, 4], [16, 16, 16, 16, 16], 24),
    # the new tokens start a piece of their own (chunk 7 follows the cached 0-1): causal, no cached part
    ("new tokens one view of their own", [0, 1, 7, 8, 9], [16, 16, 16, 16, 8], 32),
    # the new tokens' chunks are not consecutive (5, 2, 9): every piece holding new keys gets a mask
    ("new tokens over scattered chunks", [0, 1, 5, 2, 9], [16, 16, 16, 16, 16], 20),
])
def test_prefill_splits_cached_and_new_keys_exactly(name: str, ids: list[int], toks: list[int], start: int) -> None:
    """The torch path attends the cached keys without a mask and the new ones causally (one square call
    when they are one view of the pool, masked pieces otherwise); each layout matches the reference, on
    both backends."""
    gen = torch.Generator().manual_seed(5)
    hkv, g, c, d = 2, 3, 16, 32
    k_pool, v_pool = torch.randn(2, hkv, 12, c, d, generator=gen).unbind(0)
    total = sum(toks)
    n = total - start
    q = torch.randn(n, hkv * g, d, generator=gen)
    gather = torch.tensor([cid * c + t for cid, nt in zip(ids, toks, strict=True) for t in range(nt)])
    kv = (k_pool.reshape(hkv, -1, d)[:, gather], v_pool.reshape(hkv, -1, d)[:, gather])
    ref = reference(q, [kv], [start], [0, n], 0.2)
    table = torch.tensor([ids], dtype=torch.int32)
    tokens = torch.tensor([toks], dtype=torch.int32)
    for backend in BACKENDS:
        o = prefill_attention(q.to(DEV), k_pool.to(DEV), v_pool.to(DEV), table.to(DEV), tokens.to(DEV), [start],
                              [0, n], 0.2, backend=backend)
        assert float((o.cpu().double() - ref).norm() / ref.norm()) < 1e-5, (name, backend)


@pytest.mark.parametrize("path", ["flash", "matmul"])
def test_a_query_row_with_every_key_masked_is_an_empty_partial(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial whose row sees no key must not count in a log-sum-exp merge: o = 0 and lse = -inf on both
    the ATen flash path (which gives lse = 0) and the matmul path (which gives o = NaN)."""
    from chunkserve.kernels import torch_ops

    if path == "matmul":
        monkeypatch.setattr(torch_ops, "_FLASH_CPU", None)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=gen) for _ in range(3))
    bias = torch.zeros(1, 1, 3, 3)
    bias[..., 0, :] = float("-inf")  # row 0 sees nothing
    o, lse = torch_ops.partial_attention(q, k, v, 0.3, bias)
    assert torch.equal(o[:, :, 0], torch.zeros(1, 2, 8)) and bool(torch.isneginf(lse[:, :, 0]).all())
    assert bool(torch.isfinite(o[:, :, 1:]).all()) and bool(torch.isfinite(lse[:, :, 1:]).all())
