"""Two-phase partition (TPP) decode attention in Triton.

Phase 1 (``_tpp_phase1``): grid (run, kv head x split, row tile). The packed queries of a run's rows
(GQA heads as rows) attend the run's chunks (optionally split into ``n_split`` chunk segments so a
single long shared run still fills the GPU); each program writes unnormalised fp32 partials
``(acc, m, l)`` per covered row. Phase 2 (``_tpp_phase2``): grid (row, kv head, kv split). Merges
the row's partials, found through the CSR arrays (no atomics, fixed order: deterministic), then
attends the row's private chunks and writes the output. With ``kv_split > 1`` (flash-decoding, for
batches too small to fill the GPU with one program per (row, kv head)) each program attends one
segment of the row's private chunks and writes a partial; ``_tpp_reduce`` then merges the run
partials and the segment partials, in order, into the output. The paged baseline reuses
``_tpp_phase2`` (and ``_tpp_reduce``) with no runs.

The key loop, tile sizes and dot precisions are in ``triton_common``. Set ``TRITON_INTERPRET=1``
before importing this module to run on CPUs.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.triton_common import (
    _attend,
    _merge,
    check_triton_inputs,
    decode_config,
    dot_flags,
    nonempty,
    rows_config,
    sm_count,
)

KV_SPLIT_MIN_SLOTS = 512  # key slots per kv-split segment at least: its partial is then < 1% of its reads


@triton.jit(do_not_specialize=["n_split", "num_partials"])  # step-varying: no re-compiles
def _tpp_phase1(Q, K, V, PO, PM, PL, run_start, run_end, run_chunk_ptr, run_chunks, run_tokens,
                run_row_offset, scale, n_split, num_partials, stride_qb, stride_qh, stride_kh, stride_kn,
                stride_kt, HQ: tl.constexpr, G: tl.constexpr, HEAD_D: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                NATIVE: tl.constexpr, SPLIT_P: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1) // n_split
    sp = tl.program_id(1) % n_split
    i = tl.load(run_start + r)
    j = tl.load(run_end + r)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.program_id(2) * BLOCK_M < (j - i) * G:
        mask_m = offs_m < (j - i) * G
        row = i + offs_m // G
        head = h * G + offs_m % G
        offs_d = tl.arange(0, BLOCK_D)
        md_mask = mask_m[:, None] & (offs_d < HEAD_D)[None, :]
        q = tl.load(Q + row[:, None].to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                    mask=md_mask, other=0.0)
        c0 = tl.load(run_chunk_ptr + r)
        c1 = tl.load(run_chunk_ptr + r + 1)
        per = (c1 - c0 + n_split - 1) // n_split
        cs = c0 + sp * per
        ce = tl.minimum(c1, cs + per)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, K, V, h.to(tl.int64) * stride_kh, run_chunks, run_tokens,
                                cs, ce, offs_d, scale, stride_kn, stride_kt, CHUNK, BLOCK_N, HEAD_D, BLOCK_D,
                                NATIVE, SPLIT_P)
        pidx = (sp * num_partials + tl.load(run_row_offset + r) + offs_m // G).to(tl.int64) * HQ + head
        tl.store(PO + pidx[:, None] * HEAD_D + offs_d[None, :], acc, mask=md_mask)
        tl.store(PM + pidx, m_i, mask=mask_m)
        tl.store(PL + pidx, l_i, mask=mask_m)


@triton.jit
def _merge_runs(acc, m_i, l_i, PO, PM, PL, run_start, run_row_offset, seq_run_ptr, seq_runs, s, head,
                offs_d, mask_g, gd_mask, n_split, num_partials, HQ: tl.constexpr, HEAD_D: tl.constexpr):
    """Fold row ``s``'s phase-1 partials (its runs root-most first, each run's splits in order)."""
    for e in range(tl.load(seq_run_ptr + s), tl.load(seq_run_ptr + s + 1)):
        r = tl.load(seq_runs + e)
        row_off = tl.load(run_row_offset + r) + s - tl.load(run_start + r)
        for sp in range(0, n_split):
            pidx = (sp * num_partials + row_off).to(tl.int64) * HQ + head
            acc, m_i, l_i = _merge(acc, m_i, l_i,
                                   tl.load(PO + pidx[:, None] * HEAD_D + offs_d[None, :], mask=gd_mask, other=0.0),
                                   tl.load(PM + pidx, mask=mask_g, other=float("-inf")),
                                   tl.load(PL + pidx, mask=mask_g, other=0.0))
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n_split", "num_partials"])
def _tpp_phase2(Q, K, V, Out, PO, PM, PL, SO, SM, SL, run_start, run_row_offset, seq_run_ptr, seq_runs,
                chunk_start, chunk_count, chunks, tokens, scale, n_split, num_partials,
                stride_qb, stride_qh, stride_ob, stride_oh, stride_kh, stride_kn, stride_kt,
                HQ: tl.constexpr, G: tl.constexpr, HEAD_D: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                HAS_RUNS: tl.constexpr, SPLIT_KV: tl.constexpr, NATIVE: tl.constexpr, SPLIT_P: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    head = h * G + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    gd_mask = mask_g[:, None] & (offs_d < HEAD_D)[None, :]
    q = tl.load(Q + s.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=gd_mask, other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    lo = tl.load(chunk_start + s)
    hi = lo + tl.load(chunk_count + s)
    if SPLIT_KV:  # segment program_id(2) of the row's private chunks; runs are merged by _tpp_reduce
        per = tl.cdiv(hi - lo, tl.num_programs(2))
        lo = lo + tl.program_id(2) * per
        hi = tl.minimum(hi, lo + per)
    elif HAS_RUNS:
        acc, m_i, l_i = _merge_runs(acc, m_i, l_i, PO, PM, PL, run_start, run_row_offset, seq_run_ptr, seq_runs,
                                    s, head, offs_d, mask_g, gd_mask, n_split, num_partials, HQ, HEAD_D)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, K, V, h.to(tl.int64) * stride_kh, chunks, tokens, lo, hi, offs_d,
                            scale, stride_kn, stride_kt, CHUNK, BLOCK_N, HEAD_D, BLOCK_D, NATIVE, SPLIT_P)
    if SPLIT_KV:
        sidx = (tl.program_id(2) * tl.num_programs(0) + s).to(tl.int64) * HQ + head
        tl.store(SO + sidx[:, None] * HEAD_D + offs_d[None, :], acc, mask=gd_mask)
        tl.store(SM + sidx, m_i, mask=mask_g)
        tl.store(SL + sidx, l_i, mask=mask_g)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + s.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=gd_mask)


@triton.jit(do_not_specialize=["n_split", "num_partials", "kv_split"])
def _tpp_reduce(Out, PO, PM, PL, SO, SM, SL, run_start, run_row_offset, seq_run_ptr, seq_runs, n_split,
                num_partials, kv_split, stride_ob, stride_oh, HQ: tl.constexpr, G: tl.constexpr,
                HEAD_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RUNS: tl.constexpr):
    """Grid (row, kv head): the row's run partials, then its ``kv_split`` segment partials -> Out."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    head = h * G + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    gd_mask = mask_g[:, None] & (offs_d < HEAD_D)[None, :]
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_RUNS:
        acc, m_i, l_i = _merge_runs(acc, m_i, l_i, PO, PM, PL, run_start, run_row_offset, seq_run_ptr, seq_runs,
                                    s, head, offs_d, mask_g, gd_mask, n_split, num_partials, HQ, HEAD_D)
    for sp in range(0, kv_split):
        sidx = (sp * tl.num_programs(0) + s).to(tl.int64) * HQ + head
        acc, m_i, l_i = _merge(acc, m_i, l_i,
                               tl.load(SO + sidx[:, None] * HEAD_D + offs_d[None, :], mask=gd_mask, other=0.0),
                               tl.load(SM + sidx, mask=mask_g, other=float("-inf")),
                               tl.load(SL + sidx, mask=mask_g, other=0.0))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + s.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=gd_mask)


def pick_split(ctx: ChunkContext, programs: int, device: torch.device) -> int:
    """Chunk segments per run so that phase 1 launches about one program per multiprocessor.

    Measured on an H200 (docs/gpu_check_2026-12-04_H200/tune): at full sharing one wave beats two
    (bf16 GQA 32/8 at 4096: 29 against 31 µs, at 1024: 18 against 23; fp16 MHA: 42 against 49 and
    28 against 34): a program needs several key tiles to fill its pipeline, and every segment adds a
    partial that phase 2 merges."""
    sms = sm_count(device)
    if sms == 0 or ctx.num_runs == 0:
        return 1
    longest = max(n for _i, _j, _a, n, _c in ctx.runs_host)
    return max(1, min(longest, triton.cdiv(sms, max(1, programs)), 64))


def pick_kv_split(programs: int, max_chunks: int, c: int, sms: int) -> int:
    """Segments per row of phase 2 (flash-decoding) when fewer (row, kv head) programs than
    multiprocessors (``sms``) would run: enough for one program per multiprocessor, each segment at
    least ``KV_SPLIT_MIN_SLOTS`` key slots of the longest row (``max_chunks`` chunks of ``c``).
    1 when there is no GPU (``sms == 0``). Measured on an H200: 256 programs (b = 32, 8 kv heads)
    unsplit take 42 µs over 1,024 tokens, split in two 52 (their partials and the reduce cost more
    than the second wave saves)."""
    if sms <= 0:
        return 1
    longest = max_chunks // max(1, KV_SPLIT_MIN_SLOTS // c)
    return max(1, min(triton.cdiv(sms, max(1, programs)), longest, 64))


def max_private_chunks(ctx: ChunkContext, workspace: object | None = None) -> int:
    """Host-side bound on any row's private chunk count (no device sync): the widest row minus the
    fewest chunks a row reads through phase 1. O(runs + rows); memoised per context in a
    ``Workspace`` (the same for every layer of a step)."""
    memo = getattr(workspace, "memo", None)
    hit = memo.get(("max_private_chunks", id(ctx))) if memo is not None else None
    if hit is not None and hit[0] is ctx:
        return hit[1]
    diff = [0] * (ctx.batch_size + 1)  # chunks read through runs, as a difference array over rows
    for i, j, _a, n, _c in ctx.runs_host:
        diff[i] += n
        diff[j] -= n
    bound = max(0, int(ctx.block_table.shape[1]) - min(itertools.accumulate(diff[:-1]), default=0))
    if memo is not None:
        workspace.remember(("max_private_chunks", id(ctx)), (ctx, bound))  # type: ignore[union-attr]
    return bound


def decode_phase2(q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor, o: torch.Tensor,
                  runs: tuple[torch.Tensor, ...] | None, private: tuple[torch.Tensor, ...], partials: tuple,
                  scale: float, kv_split: int) -> None:
    """Launch phase 2 (and the reduce when ``kv_split > 1``) writing ``o``.

    q, o: [b, Hq, D]; runs: (run_start, run_row_offset, seq_run_ptr, seq_runs) or None (paged);
    private: (chunk_start, chunk_count, chunks, tokens); partials: (po, pm, pl, n_split, npart).
    """
    b, hq, d = q.shape
    hkv, _n, c, _d = k_pool_l.shape
    g = hq // hkv
    dev = q.device
    cfg = decode_config(d, g, q.dtype)
    po, pm, pl, n_split, npart = partials
    run_args = runs if runs is not None else (torch.zeros(1, dtype=torch.int32, device=dev),) * 4
    if kv_split > 1:
        so = torch.empty(kv_split, b, hq, d, dtype=torch.float32, device=dev)
        sm = torch.empty(kv_split, b, hq, dtype=torch.float32, device=dev)
        sl = torch.empty(kv_split, b, hq, dtype=torch.float32, device=dev)
    else:
        so = sm = sl = po
    strides = (k_pool_l.stride(0), k_pool_l.stride(1), k_pool_l.stride(2))
    _tpp_phase2[(b, hkv, kv_split)](
        q, k_pool_l, v_pool_l, o, po, pm, pl, so, sm, sl, *run_args, *private, scale, n_split, npart,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), *strides,
        HQ=hq, G=g, HEAD_D=d, CHUNK=c, BLOCK_G=cfg.block_m, **cfg.constexprs(),
        HAS_RUNS=runs is not None, SPLIT_KV=kv_split > 1, **dot_flags(q.dtype, dev), **cfg.options(),
    )
    if kv_split > 1:
        _tpp_reduce[(b, hkv)](
            o, po, pm, pl, so, sm, sl, *run_args, n_split, npart, kv_split, o.stride(0), o.stride(1),
            HQ=hq, G=g, HEAD_D=d, BLOCK_G=cfg.block_m, BLOCK_D=cfg.block_d, HAS_RUNS=runs is not None,
        )


def tpp_decode_triton(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: object | None = None,
    n_split: int | None = None,
    kv_split: int | None = None,
) -> torch.Tensor:
    """TPP decode in Triton. q_sorted: [b, Hq, D] tree order; pools [Hkv, N, c, D] -> [b, Hq, D].

    n_split: phase-1 segments per run; kv_split: phase-2 segments per row (default: chosen for the GPU).
    """
    check_triton_inputs(q_sorted, k_pool_l)
    b, hq, d = q_sorted.shape
    hkv, _n, c, _d = k_pool_l.shape
    g = hq // hkv
    q_sorted = q_sorted.contiguous()
    o = out if out is not None else torch.empty_like(q_sorted)
    dev = q_sorted.device
    num_runs = ctx.num_runs
    if num_runs:
        max_rows = max(j - i for i, j, _a, _n, _c in ctx.runs_host)
        cfg = rows_config(d, max_rows * g, q_sorted.dtype)
        block_m = cfg.block_m
        tiles = triton.cdiv(max_rows * g, block_m)
        split = n_split or pick_split(ctx, num_runs * hkv * tiles, dev)
        npart = max(1, ctx.num_partials)
        po = torch.empty(split, npart, hq, d, dtype=torch.float32, device=dev)
        pm = torch.empty(split, npart, hq, dtype=torch.float32, device=dev)
        pl = torch.empty(split, npart, hq, dtype=torch.float32, device=dev)
        _tpp_phase1[(num_runs, hkv * split, tiles)](
            q_sorted, k_pool_l, v_pool_l, po, pm, pl, ctx.run_start, ctx.run_end, ctx.run_chunk_ptr,
            nonempty(ctx.run_chunks), nonempty(ctx.run_tokens), ctx.run_row_offset, scale, split, npart,
            q_sorted.stride(0), q_sorted.stride(1), k_pool_l.stride(0), k_pool_l.stride(1), k_pool_l.stride(2),
            HQ=hq, G=g, HEAD_D=d, CHUNK=c, BLOCK_M=block_m, **cfg.constexprs(),
            **dot_flags(q_sorted.dtype, dev), **cfg.options(),
        )
        runs = (nonempty(ctx.run_start), nonempty(ctx.run_row_offset), ctx.seq_run_ptr, nonempty(ctx.seq_runs))
    else:
        split, npart = 1, 1
        po = pm = pl = torch.empty(1, dtype=torch.float32, device=dev)
        runs = None
    ptr = ctx.seq_chunk_ptr
    private = (ptr, ptr[1:] - ptr[:-1], nonempty(ctx.seq_chunks), nonempty(ctx.seq_tokens))
    kv_split = kv_split or pick_kv_split(b * hkv, max_private_chunks(ctx, workspace), c, sm_count(dev))
    decode_phase2(q_sorted, k_pool_l, v_pool_l, o, runs, private, (po, pm, pl, split, npart), scale, kv_split)
    return o
