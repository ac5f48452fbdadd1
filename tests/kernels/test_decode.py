"""TPP and paged decode attention (torch backends) against a float64 reference, via PrefixKVCache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.kernels import chunk_attention
from chunkserve.kernels.testing import random_tree, sdpa_reference
from tests.kernels.conftest import TOL

TORCH_BACKENDS = ["torch", "paged-torch", "reference"]
HEADS = [(1, 1), (4, 1), (9, 3), (32, 8), (4, 4)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _q(gen: torch.Generator, b: int, hq: int, d: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(b, hq, d, generator=gen) * scale).to(dtype)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    num_seqs=st.integers(1, 7),
    heads=st.sampled_from(HEADS),
    d=st.sampled_from([64, 128]),
    c=st.sampled_from([16, 32]),
    dtype=st.sampled_from(DTYPES),
)
def test_random_cache_trees_match_float64_reference(cache_tree, check, seed, num_seqs, heads, d, c, dtype):
    hq, hkv = heads
    tree = cache_tree(seed, hkv, d, c, dtype, device="cpu")
    ids = tree.grow(num_seqs, max_len=3 * c)
    order = torch.randperm(len(ids), generator=tree.gen).tolist()
    ids = [ids[i] for i in order]
    q = _q(tree.gen, len(ids), hq, d, dtype)
    ref = tree.reference(q, ids, d**-0.5)
    outs = {}
    for backend in TORCH_BACKENDS:
        o = chunk_attention(q, tree.cache, ids, backend=backend)
        assert o.shape == q.shape and o.dtype == dtype
        err = check.rel_err(o, ref)
        assert err < TOL[dtype], (backend, err)
        outs[backend] = o
    agree = check.rel_err(outs["torch"], outs["paged-torch"].double())
    assert agree < check.tol[dtype], agree


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_seqs=st.integers(1, 6), c=st.sampled_from([16, 32]),
       dtype=st.sampled_from(DTYPES))
def test_hand_built_trees_with_partial_middle_chunks_and_scattered_ids(seed, num_seqs, c, dtype):
    """Contexts the cache rarely makes: partly filled inner chunks, ids scattered over a NaN pool."""
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen, num_seqs, 3, 64, c, dtype=dtype, branch=0.3)
    ids = torch.randperm(len(tree.paths), generator=gen).tolist()
    q = _q(gen, len(ids), 9, 64, dtype)
    ref = torch.stack([sdpa_reference(q[i], *tree.gather(s), 64**-0.5) for i, s in enumerate(ids)])
    for backend in TORCH_BACKENDS:
        o = chunk_attention(q, tree, ids, backend=backend)
        err = float((o.double() - ref).norm() / ref.norm())
        assert torch.isfinite(o).all() and err < TOL[dtype], (backend, err)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("c", [16, 64, 256])
def test_head_dims_and_chunk_sizes(cache_tree, check, d, c):
    tree = cache_tree(d * 1000 + c, 2, d, c, torch.float32, num_chunks=64, device="cpu")
    ids = tree.grow(4, max_len=2 * c + 5, decode_steps=2)
    q = _q(tree.gen, len(ids), 4, d, torch.float32)
    ref = tree.reference(q, ids, d**-0.5)
    for backend in ("torch", "paged-torch"):
        assert check.rel_err(chunk_attention(q, tree.cache, ids, backend=backend), ref) < 1e-5


@pytest.mark.parametrize("c", [32, 128])
def test_chunk_sizes_in_bf16(cache_tree, check, c):
    tree = cache_tree(c, 2, 64, c, torch.bfloat16, num_chunks=64, device="cpu")
    ids = tree.grow(5, max_len=2 * c + 3)
    q = _q(tree.gen, len(ids), 6, 64, torch.bfloat16)
    ref = tree.reference(q, ids, 0.125)
    assert check.rel_err(chunk_attention(q, tree.cache, ids, backend="torch"), ref) < check.tol[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_do_not_overflow(cache_tree, check, dtype):
    # logits ~ +-100 (fp32; larger ones lose 1e-5 in the fp32 dot itself) or ~ +-1000 (16-bit):
    # exp() of them overflows unless the kernel subtracts the running max
    mag = 10.0 if dtype == torch.float32 else 30.0
    tree = cache_tree(7, 2, 64, 16, dtype, magnitude=mag, device="cpu")
    ids = tree.grow(5, max_len=40)
    q = _q(tree.gen, len(ids), 4, 64, dtype, scale=mag)
    assert float((q[0].double() @ tree.kv(tree.tokens[ids[0]])[0][0, :, 0].double().T).abs().max()) * 0.125 > 90
    ref = tree.reference(q, ids, 0.125)
    for backend in TORCH_BACKENDS:
        o = chunk_attention(q, tree.cache, ids, backend=backend)
        assert torch.isfinite(o).all()
        assert check.rel_err(o, ref) < check.tol[dtype]


def test_nan_poisoned_free_slots_do_not_leak(cache_tree):
    tree = cache_tree(3, 2, 64, 16, torch.float32, device="cpu")
    a = tree.add([1, 2, 3] * 7)  # 21 tokens: a full chunk and a partly filled one
    b = tree.add([1, 2, 3] * 7 + [4])
    assert torch.isnan(tree.cache.k_pool).any()  # free and unused slots still hold NaN
    q = torch.randn(2, 4, 64)
    for backend in TORCH_BACKENDS:
        assert torch.isfinite(chunk_attention(q, tree.cache, [a, b], backend=backend)).all()


def test_shapes_b1_prefix_of_another_and_no_shared_runs(cache_tree, check):
    tree = cache_tree(11, 2, 64, 16, torch.float32, device="cpu")
    s1 = tree.add(list(range(5)) * 8)  # 40 tokens
    s2 = tree.add(list(range(5)) * 4)  # a prefix of s1 (32 tokens = 2 full chunks)
    s3 = tree.add([4, 3, 2, 1] * 3)  # shares nothing
    q = torch.randn(3, 6, 64)
    for ids in ([s1], [s3], [s1, s3], [s2, s1], [s3, s2, s1]):
        qi = q[: len(ids)]
        ref = tree.reference(qi, ids, 0.125)
        for backend in TORCH_BACKENDS:
            assert check.rel_err(chunk_attention(qi, tree.cache, ids, backend=backend), ref) < 1e-5


def test_full_sharing_uses_one_contiguous_run_read_as_a_view(cache_tree, check):
    tree = cache_tree(5, 2, 64, 16, torch.float32, device="cpu")
    ids = [tree.add([1, 2, 3, 4] * 16) for _ in range(4)]  # 4 identical 64-token sequences
    ctx = tree.cache.context(ids)
    assert ctx.num_runs == 1 and ctx.runs_host[0][4] and ctx.runs_host[0][3] == 4
    assert int(ctx.seq_chunk_ptr[-1]) == 0  # no private chunks
    q = torch.randn(4, 2, 64)
    assert check.rel_err(chunk_attention(q, tree.cache, ids, backend="torch"), tree.reference(q, ids, 0.125)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_sharing_into_a_given_out_returns_it_with_the_same_values(cache_tree, dtype):
    from chunkserve.kernels import Workspace, decode_attention

    tree = cache_tree(6, 2, 64, 16, dtype, device="cpu")
    ids = [tree.add([5, 6, 7, 8] * 16) for _ in range(4)]  # one run over every row, nothing private
    ctx = tree.cache.context(ids)
    q = torch.randn(4, 4, 64).to(dtype)
    ws = Workspace()
    args = (q, tree.cache.k_pool[0], tree.cache.v_pool[0], ctx)
    fresh = decode_attention(*args, backend="torch", workspace=ws)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(*args, backend="torch", out=out, workspace=ws)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, fresh)  # out is written by the kernel
    # the same values in a strided q take the other path (q converted to fp32, the fp32 answer rounded by torch):
    # the kernel's own read of q and write of out (bf16 included) give the same bits
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(decode_attention(strided, *args[1:], backend="torch", workspace=ws), fresh)


def test_outputs_are_deterministic_and_follow_caller_order(cache_tree):
    tree = cache_tree(13, 2, 64, 16, torch.float32, device="cpu")
    ids = tree.grow(6, max_len=50)
    q = torch.randn(len(ids), 4, 64)
    for backend in ("torch", "paged-torch"):
        o1 = chunk_attention(q, tree.cache, ids, backend=backend)
        o2 = chunk_attention(q, tree.cache, ids, backend=backend)
        assert torch.equal(o1, o2)
        perm = list(reversed(range(len(ids))))
        o3 = chunk_attention(q[perm], tree.cache, [ids[i] for i in perm], backend=backend)
        assert torch.allclose(o3, o1[perm], atol=1e-6)


def test_auto_backend_and_explicit_scale(cache_tree, check):
    tree = cache_tree(17, 1, 64, 16, torch.float32, device="cpu")
    ids = tree.grow(3, max_len=30)
    q = torch.randn(len(ids), 2, 64)
    o = chunk_attention(q, tree.cache, ids, backend="auto", scale=0.3)
    assert check.rel_err(o, tree.reference(q, ids, 0.3)) < 1e-5


@pytest.mark.parametrize(
    "shared",
    [
        [(4, 16), (5, 16), (6, 9)],  # consecutive ids: read as a view
        [(9, 16), (2, 16), (6, 9)],  # scattered full chunks: one chunk-granular gather
        [(4, 16), (5, 7), (6, 16)],  # partly filled chunk inside the run (after a fork)
    ],
)
@pytest.mark.parametrize("backend", ["torch", "paged-torch", "triton", "paged-triton"])
def test_shared_run_layouts(shared, backend):
    from chunkserve.kernels.testing import ChunkTree

    gen = torch.Generator().manual_seed(0)
    k_pool = torch.full((1, 2, 12, 16, 64), float("nan"))
    v_pool = torch.full((1, 2, 12, 16, 64), float("nan"))
    for ch, nt in [*shared, (0, 3), (1, 16), (10, 5)]:
        k_pool[0, :, ch, :nt] = torch.randn(2, nt, 64, generator=gen)
        v_pool[0, :, ch, :nt] = torch.randn(2, nt, 64, generator=gen)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tree = ChunkTree(k_pool.to(dev), v_pool.to(dev), [[*shared, (0, 3)], [*shared, (1, 16), (10, 5)], list(shared)], 16)
    ctx = tree.context([0, 1, 2])
    assert ctx.num_runs == 1 and ctx.run_token_lists[0] == tuple(nt for _, nt in shared)
    q = torch.randn(3, 4, 64, generator=gen)
    ref = torch.stack([sdpa_reference(q[i], *[x.cpu() for x in tree.gather(i)], 0.125) for i in range(3)])
    o = chunk_attention(q.to(dev), tree, [0, 1, 2], backend=backend).cpu()
    assert float((o.double() - ref).norm() / ref.norm()) < 1e-5


def test_reused_workspace_gives_fresh_results_that_do_not_alias_it(cache_tree, check):
    from chunkserve.kernels import Workspace, decode_attention

    ws = Workspace()
    results = []
    for seed, (hq, hkv, d) in enumerate([(4, 2, 64), (9, 3, 128), (4, 2, 64)]):
        tree = cache_tree(seed + 40, hkv, d, 16, torch.float32, device="cpu")
        ids = tree.grow(5, max_len=50)
        ctx = tree.cache.context(ids)
        q = torch.randn(len(ids), hq, d, generator=tree.gen)
        q_sorted = q.index_select(0, ctx.order)
        ref = tree.reference(q_sorted, [ids[i] for i in ctx.order.tolist()], d**-0.5)
        for backend in ("torch", "paged-torch"):
            o = decode_attention(q_sorted, tree.cache.k_pool[0], tree.cache.v_pool[0], ctx, backend=backend,
                                 workspace=ws)
            assert check.rel_err(o, ref) < 1e-5
            results.append((o, o.clone()))
            out = torch.empty_like(q_sorted)
            decode_attention(q_sorted, tree.cache.k_pool[0], tree.cache.v_pool[0], ctx, backend=backend, out=out,
                             workspace=ws)
            assert check.rel_err(out, ref) < 1e-5
    assert all(torch.equal(o, kept) for o, kept in results)  # later calls did not overwrite earlier outputs


@pytest.mark.parametrize("backend", ["torch", "paged-torch"])
def test_private_chunk_with_no_valid_tokens_reads_no_poisoned_slot(backend):
    """A row whose first private chunk holds 0 tokens has no valid stand-in slot: its gathered slots
    are zeroed instead, and the NaN pool around them never reaches the output."""
    from chunkserve.kernels.testing import ChunkTree

    gen = torch.Generator().manual_seed(3)
    k_pool = torch.full((1, 2, 8, 16, 64), float("nan"))
    v_pool = torch.full((1, 2, 8, 16, 64), float("nan"))
    paths = [[(2, 16), (3, 0), (4, 5)], [(5, 7)], [(6, 16), (7, 1)]]
    for path in paths:
        for ch, nt in path:
            k_pool[0, :, ch, :nt] = torch.randn(2, nt, 64, generator=gen)
            v_pool[0, :, ch, :nt] = torch.randn(2, nt, 64, generator=gen)
    # row 0's zero-token chunk is the first of a position group when a group is one position wide
    paths = [[(3, 0), (4, 5)], [(5, 7)], [(6, 16), (7, 1)]]
    tree = ChunkTree(k_pool, v_pool, paths, 16)
    q = torch.randn(3, 4, 64, generator=gen)
    ref = torch.stack([sdpa_reference(q[i], *tree.gather(i), 0.125) for i in range(3)])
    o = chunk_attention(q, tree, [0, 1, 2], backend=backend)
    assert torch.isfinite(o).all()
    assert float((o.double() - ref).norm() / ref.norm()) < 1e-5
