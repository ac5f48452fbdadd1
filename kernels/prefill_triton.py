"""Prefill attention over a cached prefix in Triton: grid (row, kv head, packed query tile).

Each program holds ``BLOCK_M`` packed (token, GQA head) query rows of one sequence and walks the
sequence's chunks in order, skipping chunks that start after its last query position; keys are
masked by the chunk's valid tokens and by causality (key position <= query position).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chunkserve.kernels.tpp_triton import _chunk_update, check_triton_inputs, dot_modes


@triton.jit
def _prefill_kernel(Q, K, V, Out, table, tokens, block_pos, q_start, cu_q, scale, width,
                    stride_qt, stride_qh, stride_kh, stride_kn, stride_kt,
                    G: tl.constexpr, HEAD_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QK_NATIVE: tl.constexpr,
                    PV_TF32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    t_lo = tl.load(cu_q + b)
    n_b = tl.load(cu_q + b + 1) - t_lo
    if tl.program_id(2) * BLOCK_M < n_b * G:
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_b * G
        tok = offs_m // G
        head = h * G + offs_m % G
        q_pos = tl.load(q_start + b) + tok
        max_pos = tl.load(q_start + b) + (tl.minimum((tl.program_id(2) + 1) * BLOCK_M, n_b * G) - 1) // G + 1
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_D
        qmask = mask_m[:, None] & dmask[None, :]
        q_ptrs = Q + (t_lo + tok[:, None]).to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=qmask, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for jj in range(0, width):
            nt = tl.load(tokens + b * width + jj)
            pos0 = tl.load(block_pos + b * width + jj)
            if (nt > 0) & (pos0 < max_pos):
                ch = tl.load(table + b * width + jj).to(tl.int64)
                base = h.to(tl.int64) * stride_kh + ch * stride_kn
                acc, m_i, l_i = _chunk_update(q, acc, m_i, l_i, K + base, V + base, nt, offs_d, dmask, scale,
                                              stride_kt, CHUNK, BLOCK_N, QK_NATIVE, PV_TF32, pos0, q_pos,
                                              CAUSAL=True)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o_ptrs = Out + (t_lo + tok[:, None]).to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=qmask)


def prefill_triton(
    q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor, block_table: torch.Tensor,
    block_tokens: torch.Tensor, starts: list[int], cu: list[int], scale: float,
) -> torch.Tensor:
    """Launch the prefill kernel. q: [T, Hq, D] (rows' new tokens concatenated) -> [T, Hq, D]."""
    check_triton_inputs(q, k_pool_l)
    hkv, _n, c, d = k_pool_l.shape
    hq = q.shape[1]
    g = hq // hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    b = len(starts)
    if q.shape[0] == 0 or b == 0:
        return out
    dev = q.device
    table = block_table.to(device=dev, dtype=torch.int32).contiguous()
    toks = block_tokens.to(device=dev, dtype=torch.int32).contiguous()
    block_pos = (torch.cumsum(toks, dim=1, dtype=torch.int32) - toks).contiguous()
    q_start = torch.tensor(starts, dtype=torch.int32, device=dev)
    cu_q = torch.tensor(cu, dtype=torch.int32, device=dev)
    max_rows = max(cu[i + 1] - cu[i] for i in range(b)) * g
    block_m = 16 if max_rows <= 16 else 32 if max_rows <= 32 else 64
    block_d = max(16, triton.next_power_of_2(d))
    block_n = max(16, min(c, 64 if block_d <= 128 else 32))
    qk_native, pv_tf32 = dot_modes(q.dtype, dev)
    grid = (b, hkv, triton.cdiv(max_rows, block_m))
    _prefill_kernel[grid](
        q, k_pool_l, v_pool_l, out, table, toks, block_pos, q_start, cu_q, scale, table.shape[1],
        q.stride(0), q.stride(1), k_pool_l.stride(0), k_pool_l.stride(1), k_pool_l.stride(2),
        G=g, HEAD_D=d, CHUNK=c, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        QK_NATIVE=qk_native, PV_TF32=pv_tf32,
    )
    return out
