"""Two-phase partition (TPP) decode attention in Triton.

Phase 1 (``_tpp_phase1``): grid (run, kv head x split, row tile). The packed queries of a run's rows
(GQA heads as rows) attend the run's chunks (optionally split into ``n_split`` chunk segments so a
single long shared run still fills the GPU); each program writes unnormalised fp32 partials
``(acc, m, l)`` per covered row. Phase 2 (``_tpp_phase2``): grid (row, kv head). Merges the row's
partials, found through the CSR arrays (no atomics, fixed order: deterministic), then attends the
row's private chunks and writes the output. The paged baseline reuses ``_tpp_phase2`` with no runs.

Set ``TRITON_INTERPRET=1`` before importing this module to run on CPUs. Dots up-cast to fp32 with
``input_precision="ieee"`` unless the inputs are 16-bit on a GPU (then QK^T runs natively with fp32
accumulation and P@V in TF32, keeping P at 10 mantissa bits).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from chunkserve.kernels.context import ChunkContext


@triton.jit
def _chunk_update(q, acc, m_i, l_i, k_base, v_base, nt, offs_d, dmask, scale, stride_kt,
                  CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, QK_NATIVE: tl.constexpr,
                  PV_TF32: tl.constexpr, pos0=0, q_pos=0, CAUSAL: tl.constexpr = False):
    """Online-softmax update of (acc, m, l) with the first ``nt`` tokens of one chunk.

    CAUSAL (prefill): the chunk's first token sits at position ``pos0`` and query row r at
    ``q_pos[r]``; keys after a row's position are masked.
    """
    for t0 in tl.static_range(0, CHUNK, BLOCK_N):
        if t0 < nt:
            offs_n = t0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < nt
            kv_mask = mask_n[:, None] & dmask[None, :]
            ptrs = offs_n[:, None] * stride_kt + offs_d[None, :]
            k = tl.load(k_base + ptrs, mask=kv_mask, other=0.0)
            if QK_NATIVE:
                s = tl.dot(q, tl.trans(k))
            else:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            ok = mask_n[None, :]
            if CAUSAL:
                ok = ok & ((pos0 + offs_n)[None, :] <= q_pos[:, None])
            s = tl.where(ok, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + ptrs, mask=kv_mask, other=0.0).to(tl.float32)
            if PV_TF32:
                pv = tl.dot(p, v, input_precision="tf32")
            else:
                pv = tl.dot(p, v, input_precision="ieee")
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tpp_phase1(Q, K, V, PO, PM, PL, run_start, run_end, run_chunk_ptr, run_chunks, run_tokens,
                run_row_offset, scale, n_split, num_partials, stride_qb, stride_qh, stride_kh, stride_kn,
                stride_kt, HQ: tl.constexpr, G: tl.constexpr, HEAD_D: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                QK_NATIVE: tl.constexpr, PV_TF32: tl.constexpr):
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
        dmask = offs_d < HEAD_D
        q_ptrs = Q + row[:, None].to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & dmask[None, :], other=0.0)
        c0 = tl.load(run_chunk_ptr + r)
        c1 = tl.load(run_chunk_ptr + r + 1)
        per = (c1 - c0 + n_split - 1) // n_split
        cs = c0 + sp * per
        ce = tl.minimum(c1, cs + per)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kk in range(cs, ce):
            ch = tl.load(run_chunks + kk).to(tl.int64)
            nt = tl.load(run_tokens + kk)
            base = h.to(tl.int64) * stride_kh + ch * stride_kn
            acc, m_i, l_i = _chunk_update(q, acc, m_i, l_i, K + base, V + base, nt, offs_d, dmask, scale,
                                          stride_kt, CHUNK, BLOCK_N, QK_NATIVE, PV_TF32)
        pidx = (sp * num_partials + tl.load(run_row_offset + r) + offs_m // G).to(tl.int64) * HQ + head
        tl.store(PO + pidx[:, None] * HEAD_D + offs_d[None, :], acc, mask=mask_m[:, None] & dmask[None, :])
        tl.store(PM + pidx, m_i, mask=mask_m)
        tl.store(PL + pidx, l_i, mask=mask_m)


@triton.jit
def _tpp_phase2(Q, K, V, Out, PO, PM, PL, run_start, run_row_offset, seq_run_ptr, seq_runs,
                chunk_start, chunk_count, chunks, tokens, scale, n_split, num_partials,
                stride_qb, stride_qh, stride_ob, stride_oh, stride_kh, stride_kn, stride_kt,
                HQ: tl.constexpr, G: tl.constexpr, HEAD_D: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                HAS_RUNS: tl.constexpr, QK_NATIVE: tl.constexpr, PV_TF32: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    head = h * G + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_D
    gd_mask = mask_g[:, None] & dmask[None, :]
    q = tl.load(Q + s.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=gd_mask, other=0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_RUNS:
        e0 = tl.load(seq_run_ptr + s)
        e1 = tl.load(seq_run_ptr + s + 1)
        for e in range(e0, e1):
            r = tl.load(seq_runs + e)
            row_off = tl.load(run_row_offset + r) + s - tl.load(run_start + r)
            for sp in range(0, n_split):
                pidx = (sp * num_partials + row_off).to(tl.int64) * HQ + head
                pm = tl.load(PM + pidx, mask=mask_g, other=float("-inf"))
                pl = tl.load(PL + pidx, mask=mask_g, other=0.0)
                po = tl.load(PO + pidx[:, None] * HEAD_D + offs_d[None, :], mask=gd_mask, other=0.0)
                m_new = tl.maximum(m_i, pm)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                beta = tl.exp(pm - m_safe)
                acc = acc * alpha[:, None] + po * beta[:, None]
                l_i = l_i * alpha + pl * beta
                m_i = m_new
    c0 = tl.load(chunk_start + s)
    cn = tl.load(chunk_count + s)
    for kk in range(c0, c0 + cn):
        ch = tl.load(chunks + kk).to(tl.int64)
        nt = tl.load(tokens + kk)
        base = h.to(tl.int64) * stride_kh + ch * stride_kn
        acc, m_i, l_i = _chunk_update(q, acc, m_i, l_i, K + base, V + base, nt, offs_d, dmask, scale,
                                      stride_kt, CHUNK, BLOCK_N, QK_NATIVE, PV_TF32)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(Out + s.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=gd_mask)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_modes(dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    """(QK_NATIVE, PV_TF32): native 16-bit dots only on a real GPU."""
    native = dtype != torch.float32 and device.type == "cuda" and not interpreting()
    return native, native


def check_triton_inputs(q: torch.Tensor, k_pool_l: torch.Tensor) -> None:
    """Reject what the Triton kernels cannot run (bf16 in the interpreter, non-CUDA without it)."""
    if k_pool_l.device.type != "cuda" and not interpreting():
        raise ValueError("triton backends need a CUDA device (or TRITON_INTERPRET=1 set before import)")
    if interpreting() and q.dtype == torch.bfloat16:
        raise ValueError("bf16 triton kernels run on GPUs only (the interpreter cannot); use fp16/fp32")
    if not k_pool_l.is_contiguous():
        raise ValueError("pool layer must be contiguous [Hkv, N, c, D]")


def block_sizes(d: int, c: int, g: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, BLOCK_G) chosen in Python (no autotune)."""
    block_d = max(16, triton.next_power_of_2(d))
    block_n = min(c, 64 if block_d <= 128 else 32)
    return block_d, max(16, block_n), max(16, triton.next_power_of_2(g))


def pick_split(ctx: ChunkContext, programs: int, device: torch.device) -> int:
    """Chunk segments per run so that phase 1 launches about two waves of programs on a GPU."""
    if device.type != "cuda" or interpreting() or ctx.num_runs == 0:
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    longest = max(n for _i, _j, _a, n, _c in ctx.runs_host)
    return max(1, min(longest, triton.cdiv(target, max(1, programs)), 64))


def nonempty(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a 1-element stand-in when empty (a CUDA launch rejects the null pointer of an
    empty tensor; the kernels never read it then)."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


def tpp_decode_triton(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: object | None = None,
    n_split: int | None = None,
) -> torch.Tensor:
    """TPP decode in Triton. q_sorted: [b, Hq, D] tree order; pools [Hkv, N, c, D] -> [b, Hq, D]."""
    check_triton_inputs(q_sorted, k_pool_l)
    b, hq, d = q_sorted.shape
    hkv, _n, c, _d = k_pool_l.shape
    g = hq // hkv
    q_sorted = q_sorted.contiguous()
    o = out if out is not None else torch.empty_like(q_sorted)
    block_d, block_n, block_g = block_sizes(d, c, g)
    qk_native, pv_tf32 = dot_modes(q_sorted.dtype, q_sorted.device)
    dev = q_sorted.device
    strides = (k_pool_l.stride(0), k_pool_l.stride(1), k_pool_l.stride(2))
    num_runs = ctx.num_runs
    if num_runs:
        max_rows = max(j - i for i, j, _a, _n, _c in ctx.runs_host)
        block_m = 16 if max_rows * g <= 16 else 32 if max_rows * g <= 32 else 64
        tiles = triton.cdiv(max_rows * g, block_m)
        split = n_split or pick_split(ctx, num_runs * hkv * tiles, dev)
        npart = max(1, ctx.num_partials)
        po = torch.empty(split, npart, hq, d, dtype=torch.float32, device=dev)
        pm = torch.empty(split, npart, hq, dtype=torch.float32, device=dev)
        pl = torch.empty(split, npart, hq, dtype=torch.float32, device=dev)
        _tpp_phase1[(num_runs, hkv * split, tiles)](
            q_sorted, k_pool_l, v_pool_l, po, pm, pl, ctx.run_start, ctx.run_end, ctx.run_chunk_ptr,
            nonempty(ctx.run_chunks), nonempty(ctx.run_tokens), ctx.run_row_offset, scale, split, npart,
            q_sorted.stride(0), q_sorted.stride(1), *strides,
            HQ=hq, G=g, HEAD_D=d, CHUNK=c, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            QK_NATIVE=qk_native, PV_TF32=pv_tf32,
        )
    else:
        split, npart = 1, 1
        po = pm = pl = torch.empty(1, dtype=torch.float32, device=dev)
    ptr = ctx.seq_chunk_ptr
    count = ptr[1:] - ptr[:-1]
    _tpp_phase2[(b, hkv)](
        q_sorted, k_pool_l, v_pool_l, o, po, pm, pl, nonempty(ctx.run_start), nonempty(ctx.run_row_offset),
        ctx.seq_run_ptr, nonempty(ctx.seq_runs), ptr, count, nonempty(ctx.seq_chunks), nonempty(ctx.seq_tokens),
        scale, split, npart,
        q_sorted.stride(0), q_sorted.stride(1), o.stride(0), o.stride(1), *strides,
        HQ=hq, G=g, HEAD_D=d, CHUNK=c, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_RUNS=num_runs > 0, QK_NATIVE=qk_native, PV_TF32=pv_tf32,
    )
    return o
