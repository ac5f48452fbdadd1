"""The CPU phase-1 kernel (``cs_run_attention``): every run's stacked queries against its chunks, read
in place, checked against float64 per-run references, for both row-block tiles, splits and threads."""

from __future__ import annotations

import pytest
import torch

from chunkserve.kernels import cpu_kernel
from chunkserve.kernels.cpu_kernel import RunTable, run_attention
from chunkserve.kernels.testing import lse_reference, run_kv, sdpa_reference, torch_threads
from chunkserve.kernels.torch_ops import Workspace

pytestmark = pytest.mark.skipif(cpu_kernel.load_cpu_kernel() is None, reason="no C++ compiler for the CPU kernel")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _pools(gen: torch.Generator, hkv: int, n: int, c: int, d: int, dtype: torch.dtype):
    """NaN-filled pools: any slot a kernel reads without writing it first poisons the result."""
    k = torch.full((hkv, n, c, d), float("nan"), dtype=dtype)
    v = torch.full((hkv, n, c, d), float("nan"), dtype=dtype)
    return k, v


def _fill(gen, k, v, chunks: list[int], tokens: list[int]) -> None:
    hkv, _n, _c, d = k.shape
    for ch, nt in zip(chunks, tokens, strict=True):
        k[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(k.dtype)
        v[:, ch, :nt] = torch.randn(hkv, nt, d, generator=gen).to(v.dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,hkv,g", [(32, 3, 3), (32, 2, 1), (11, 2, 3), (5, 1, 4), (19, 1, 4), (22, 1, 4)])
def test_nested_runs_match_float64_references_and_leave_other_rows_alone(check, threads, dtype, b, hkv, g):
    """Rows [0, b) share a long run, a nested run covers a middle slice, a third run two rows; the
    row counts exercise both tiles (M a multiple of 2 or of 3 vectors) and a ragged last row block (the bf16 pair
    path computes a block's rows in 1, 1.5, 2 or 2.5 vectors of 3: blocks of 40 and 28 rows with b = 22, 19)."""
    gen = torch.Generator().manual_seed(b * 100 + hkv * 10 + g)
    d, c = 64, 16
    k_pool, v_pool = _pools(gen, hkv, 64, c, d, dtype)
    perm = torch.randperm(64, generator=gen).tolist()
    runs = [(0, b), (b // 4, b // 4 + max(1, b // 2)), (b - 2 if b > 2 else 0, b)]
    chunk_lists = [tuple(perm[0:9]), tuple(perm[9:12]), tuple(perm[12:13])]
    token_lists = [(c,) * 8 + (7,), (c, c, 3), (1,)]  # partly filled chunks: slots past them hold NaN
    for cl, tl in zip(chunk_lists, token_lists, strict=True):
        _fill(gen, k_pool, v_pool, list(cl), list(tl))
    table = RunTable.build(runs, chunk_lists, token_lists)
    q = torch.randn(b, hkv, g, d, generator=gen).to(dtype).float()  # a model's queries are in its pool's dtype
    part_o = torch.full((4, b, hkv, g, d), 7.0)
    part_lse = torch.full((4, b, hkv, g), 7.0)
    with torch_threads(threads):
        run_attention(cpu_kernel.load_cpu_kernel(), q, k_pool, v_pool, table, d**-0.5, part_o, part_lse, Workspace())
    tol = 1e-5 if dtype == torch.float32 else check.tol[dtype]
    for r, ((i, j), cl, tl) in enumerate(zip(runs, chunk_lists, token_lists, strict=True)):
        keys, vals = run_kv(k_pool, v_pool, cl, tl)  # [Hkv, T, D]
        for h in range(hkv):
            qh = q[i:j, h].reshape(-1, d)  # [(j-i)*g, D]
            ref = sdpa_reference(qh, keys[h : h + 1], vals[h : h + 1], d**-0.5)  # one KV head, M query heads
            assert check.rel_err(part_o[r, i:j, h].reshape(-1, d), ref) < tol, (r, h)
            lse = lse_reference(qh, keys[h], d**-0.5)
            assert torch.allclose(part_lse[r, i:j, h].reshape(-1).double(), lse, atol=1e-3), (r, h)
        outside = torch.ones(b, dtype=torch.bool)
        outside[i:j] = False
        assert (part_o[r, outside] == 7.0).all() and (part_lse[r, outside] == 7.0).all()
    assert (part_o[3] == 7.0).all()  # a slot past the runs is never written


@pytest.mark.parametrize("d", [16, 80, 128])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_bf16_runs_match_references_for_head_dims_off_the_pair_tiles_and_any_scale(check, d, scale):
    """bf16 chunks take the vdpbf16ps path where the CPU has AVX512-BF16: head dims that leave a 16-wide tail of
    the 32-wide P@V tile (16, 80), odd token counts (an unpaired last key) and a softmax scale other than
    d^-0.5 (queries are packed unscaled, the scores scaled) all match the float64 reference."""
    if d % cpu_kernel.load_cpu_kernel().vector_width:
        pytest.skip("head dim is not a multiple of this CPU's vector width")
    gen = torch.Generator().manual_seed(d)
    b, hkv, g, c = 7, 2, 2, 16
    sc = d**-0.5 if scale is None else scale
    k_pool, v_pool = _pools(gen, hkv, 32, c, d, torch.bfloat16)
    chunks, tokens = (5, 17, 2, 30), (c, c, 11, 5)
    _fill(gen, k_pool, v_pool, list(chunks), list(tokens))
    table = RunTable.build([(0, b)], [chunks], [tokens])
    q = torch.randn(b, hkv, g, d, generator=gen).to(torch.bfloat16).float()
    part_o, part_lse = torch.full((1, b, hkv, g, d), 7.0), torch.full((1, b, hkv, g), 7.0)
    run_attention(cpu_kernel.load_cpu_kernel(), q, k_pool, v_pool, table, sc, part_o, part_lse, Workspace())
    keys, vals = run_kv(k_pool, v_pool, chunks, tokens)  # [Hkv, T, D]
    for h in range(hkv):
        qh = q[:, h].reshape(-1, d)
        ref = sdpa_reference(qh, keys[h : h + 1], vals[h : h + 1], sc)
        assert check.rel_err(part_o[0, :, h].reshape(-1, d), ref) < check.tol[torch.bfloat16], h
        lse = torch.logsumexp((qh.double() @ keys[h].double().T) * sc, -1)
        assert torch.allclose(part_lse[0, :, h].reshape(-1).double(), lse, atol=1e-3), h


@pytest.mark.parametrize("threads", [2, 4])
def test_one_long_run_with_few_heads_is_split_and_merged_exactly(check, threads, monkeypatch):
    """Runs x heads < 4 threads: the run's chunks are split into ranges merged by log-sum-exp."""
    monkeypatch.setattr(cpu_kernel, "SERIAL_ELEMENTS", 0)  # a call this small would run on one thread, unsplit
    gen = torch.Generator().manual_seed(3)
    b, hkv, g, d, c = 4, 1, 3, 64, 16
    k_pool, v_pool = _pools(gen, hkv, 80, c, d, torch.float32)
    chunks = tuple(torch.randperm(80, generator=gen)[:64].tolist())
    tokens = (c,) * 63 + (9,)
    _fill(gen, k_pool, v_pool, list(chunks), list(tokens))
    table = RunTable.build([(0, b)], [chunks], [tokens])
    q = torch.randn(b, hkv, g, d, generator=gen)
    part_o, part_lse = torch.empty(1, b, hkv, g, d), torch.empty(1, b, hkv, g)
    ws = Workspace()
    with torch_threads(threads):
        run_attention(cpu_kernel.load_cpu_kernel(), q, k_pool, v_pool, table, d**-0.5, part_o, part_lse, ws)
    assert "cpuk_run_so" in ws._bufs  # the split scratch was used: the run really was split
    keys = torch.cat([k_pool[0, ch, :nt] for ch, nt in zip(chunks, tokens, strict=True)])  # [T, D]
    vals = torch.cat([v_pool[0, ch, :nt] for ch, nt in zip(chunks, tokens, strict=True)])
    qh = q[:, 0].reshape(-1, d)
    ref = sdpa_reference(qh, keys[None], vals[None], d**-0.5)
    assert check.rel_err(part_o[0, :, 0].reshape(-1, d), ref) < 1e-5


@pytest.mark.parametrize("split", [False, True])
def test_bf16_q_and_output_are_read_and_written_as_fp32_ones_rounded(split, monkeypatch):
    """A bf16 q read as it lies and a bf16 output written by the kernel (kQBf16, kOutBf16) give the bits of the fp32
    call over the same q with its output rounded by torch, on one item per head and with the run's chunks split and
    merged."""
    if split:
        monkeypatch.setattr(cpu_kernel, "SERIAL_ELEMENTS", 0)  # a call this small would run on one thread, unsplit
    gen = torch.Generator().manual_seed(5)
    b, hkv, g, d, c = 4, 1, 3, 64, 16
    k_pool, v_pool = _pools(gen, hkv, 80, c, d, torch.bfloat16)
    chunks = tuple(torch.randperm(80, generator=gen)[:64].tolist())  # long enough to be split
    tokens = (c,) * 63 + (5,)
    _fill(gen, k_pool, v_pool, list(chunks), list(tokens))
    table = RunTable.build([(0, b)], [chunks], [tokens])
    q = torch.randn(b, hkv, g, d, generator=gen).to(torch.bfloat16)
    kern = cpu_kernel.load_cpu_kernel()
    outs = {}
    for name, qq, dtype in (("fp32", q.float(), torch.float32), ("bf16", q, torch.bfloat16)):
        o, lse = torch.full((1, b, hkv, g, d), float("nan"), dtype=dtype), torch.empty(1, b, hkv, g)
        ws = Workspace()
        with torch_threads(2):
            run_attention(kern, qq, k_pool, v_pool, table, d**-0.5, o, lse, ws)
        assert ("cpuk_run_so" in ws._bufs) == split  # the run was split (and merged) only where asked
        outs[name] = (o, lse)
    assert torch.equal(outs["bf16"][0], outs["fp32"][0].to(torch.bfloat16))
    assert torch.equal(outs["bf16"][1], outs["fp32"][1])


def test_bf16_output_refuses_accumulate():
    gen = torch.Generator().manual_seed(6)
    k_pool, v_pool = _pools(gen, 1, 4, 16, 64, torch.bfloat16)
    table = RunTable.build([(0, 2)], [(0, 1)], [(16, 16)])
    q = torch.randn(2, 1, 1, 64, generator=gen)
    o, lse = torch.zeros(1, 2, 1, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 1, 1)
    with pytest.raises(ValueError, match="bf16 without accumulate"):
        run_attention(cpu_kernel.load_cpu_kernel(), q, k_pool, v_pool, table, 0.125, o, lse, Workspace(),
                      one_slot=True, accumulate=True)


def test_head_dim_that_is_not_a_multiple_of_the_vector_width_is_not_offered_to_the_kernel():
    kern = cpu_kernel.load_cpu_kernel()
    d = kern.vector_width + 2
    q = torch.zeros(2, 1, 1, d)
    pool = torch.zeros(1, 4, 16, d)
    assert not kern.supports(q, pool) and not kern.supports_runs(q, pool)  # it read past such a head


@pytest.mark.parametrize("threads,split", [(1, False), (2, False), (2, True), (4, True)])
def test_accumulate_merges_each_runs_partial_into_the_rows_existing_partial(check, threads, split, monkeypatch):
    """With ``accumulate`` the kernel merges by log-sum-exp into (o, lse) instead of overwriting: rows that
    already hold another key set's partial end with attention over both key sets, rows in no run keep theirs,
    and a row that held nothing (lse -inf) gets the run's partial alone; split runs merge the same way."""
    if split:
        monkeypatch.setattr(cpu_kernel, "SERIAL_ELEMENTS", 0)  # so that a call this small runs on threads
    gen = torch.Generator().manual_seed(11 + split)
    b, hkv, g, d, c = 6, 1 if split else 2, 3, 64, 16
    k_pool, v_pool = _pools(gen, hkv, 80, c, d, torch.float32)
    perm = torch.randperm(80, generator=gen).tolist()
    n_run = 40 if split else 5  # a long run on one head is split (runs x heads < 4 threads)
    runs = [(0, 2), (2, 5)]  # disjoint rows; row 5 is in no run
    chunk_lists = [tuple(perm[:n_run]), tuple(perm[n_run:n_run + 3])]
    token_lists = [(c,) * (n_run - 1) + (5,), (c, c, 11)]
    other = perm[n_run + 3:n_run + 5]  # the key set of the partial already held
    for cl, tl in zip(chunk_lists, token_lists, strict=True):
        _fill(gen, k_pool, v_pool, list(cl), list(tl))
    _fill(gen, k_pool, v_pool, other, [c, 9])
    q = torch.randn(b, hkv, g, d, generator=gen)

    def keys_of(chs, tks):
        return (torch.cat([k_pool[:, ch, :nt] for ch, nt in zip(chs, tks, strict=True)], 1),
                torch.cat([v_pool[:, ch, :nt] for ch, nt in zip(chs, tks, strict=True)], 1))

    ko, vo = keys_of(other, [c, 9])
    o = torch.empty(1, b, hkv, g, d)
    lse = torch.empty(1, b, hkv, g)
    for h in range(hkv):  # every row holds attention over `other`, except row 0 (nothing yet)
        qh = q[:, h].reshape(-1, d)
        o[0, :, h] = sdpa_reference(qh, ko[h:h + 1], vo[h:h + 1], d**-0.5).reshape(b, g, d).float()
        lse[0, :, h] = torch.logsumexp((qh.double() @ ko[h].double().T) * d**-0.5, -1).reshape(b, g).float()
    o[0, 0], lse[0, 0] = float("nan"), float("-inf")  # a row that holds nothing: its o is never read
    held_o, held_lse = o[0, 5].clone(), lse[0, 5].clone()
    table = RunTable.build(runs, chunk_lists, token_lists)
    ws = Workspace()
    with torch_threads(threads):
        run_attention(cpu_kernel.load_cpu_kernel(), q, k_pool, v_pool, table, d**-0.5, o, lse, ws,
                      one_slot=True, accumulate=True)
    assert ("cpuk_run_so" in ws._bufs) == split
    for (i, j), cl, tl in zip(runs, chunk_lists, token_lists, strict=True):
        kr, vr = keys_of(cl, tl)
        for r in range(i, j):
            keys, vals = (kr, vr) if r == 0 else (torch.cat([kr, ko], 1), torch.cat([vr, vo], 1))
            for h in range(hkv):
                ref = sdpa_reference(q[r, h], keys[h:h + 1], vals[h:h + 1], d**-0.5)
                assert check.rel_err(o[0, r, h], ref) < 1e-5, (r, h)
                want = torch.logsumexp((q[r, h].double() @ keys[h].double().T) * d**-0.5, -1)
                assert torch.allclose(lse[0, r, h].double(), want, atol=1e-4), (r, h)
    assert torch.equal(o[0, 5], held_o) and torch.equal(lse[0, 5], held_lse)


def test_accumulate_without_one_slot_is_refused():
    table = RunTable.build([(0, 1)], [(0,)], [(4,)])
    pool = torch.zeros(1, 2, 16, 64)
    with pytest.raises(ValueError, match="one_slot"):
        run_attention(cpu_kernel.load_cpu_kernel(), torch.zeros(1, 1, 1, 64), pool, pool, table, 0.125,
                      torch.zeros(1, 1, 1, 1, 64), torch.zeros(1, 1, 1, 1), Workspace(), accumulate=True)


def test_a_long_run_is_split_so_that_its_items_fill_every_thread_evenly(monkeypatch):
    """One run on 3 KV heads over 16 chunks on 2 threads: 2 splits (6 items, 3 rounds of half a run) rather
    than 3 (9 items, 5 rounds of a third) or none (3 items, 2 rounds of a whole run)."""
    table = RunTable.build([(0, 16)], [tuple(range(16))], [(64,) * 16])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    threads, nsplit, _ = cpu_kernel.run_launch_params(table, 3, 3, 64, 64)
    assert (threads, nsplit) == (2, 2)
