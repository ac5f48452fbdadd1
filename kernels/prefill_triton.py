"""Prefill attention over a cached prefix in Triton: grid (row, kv head, packed query tile).

Each program holds ``BLOCK_M`` packed (token, GQA head) query rows of one sequence and walks the
sequence's chunks in order up to the last chunk that starts before its last query position (found
once, up front, so that the key loop itself has no branch and pipelines); keys are masked by the
chunk's valid tokens and by causality (key position <= query position).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chunkserve.kernels.prefill import PrefillTables
from chunkserve.kernels.triton_common import _attend, check_triton_inputs, dot_flags, rows_config


@triton.jit(do_not_specialize=["width"])  # chunks per row vary per step: no re-compiles
def _prefill_kernel(Q, K, V, Out, table, tokens, block_pos, q_start, cu_q, scale, width,
                    stride_qt, stride_qh, stride_kh, stride_kn, stride_kt,
                    G: tl.constexpr, HEAD_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                    NATIVE: tl.constexpr, SPLIT_P: tl.constexpr):
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
        row_table = b * width
        # chunks past the last one holding a key at or before this tile's last query are skipped
        end = tl.program_id(0) * 0
        for w0 in range(0, width, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            in_w = offs_w < width
            nt = tl.load(tokens + row_table + offs_w, mask=in_w, other=0)
            pos0 = tl.load(block_pos + row_table + offs_w, mask=in_w, other=max_pos)
            end = tl.maximum(end, tl.max(tl.where((nt > 0) & (pos0 < max_pos), offs_w + 1, 0), 0))
        offs_d = tl.arange(0, BLOCK_D)
        qmask = mask_m[:, None] & (offs_d < HEAD_D)[None, :]
        q_ptrs = Q + (t_lo + tok[:, None]).to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=qmask, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, K, V, h.to(tl.int64) * stride_kh, table + row_table,
                                tokens + row_table, 0, end, offs_d, scale, stride_kn, stride_kt, CHUNK, BLOCK_N,
                                HEAD_D, BLOCK_D, NATIVE, SPLIT_P, block_pos + row_table, q_pos, CAUSAL=True)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o_ptrs = Out + (t_lo + tok[:, None]).to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=qmask)


def prefill_triton(q: torch.Tensor, k_pool_l: torch.Tensor, v_pool_l: torch.Tensor, tables: PrefillTables,
                   scale: float) -> torch.Tensor:
    """Launch the prefill kernel. q: [T, Hq, D] (rows' new tokens concatenated) -> [T, Hq, D].

    Every index array comes from ``tables`` (built once per step, on the device already): nothing is
    built from host lists or read back here, per layer.
    """
    check_triton_inputs(q, k_pool_l)
    hkv, _n, c, d = k_pool_l.shape
    hq = q.shape[1]
    g = hq // hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    starts, cu = tables.starts, tables.cu
    b = len(starts)
    if q.shape[0] == 0 or b == 0:
        return out
    dev = q.device
    table, toks = tables.block_table, tables.block_tokens  # [b, width] int32 each
    max_rows = max(cu[i + 1] - cu[i] for i in range(b)) * g
    cfg = rows_config(d, max_rows, q.dtype)
    block_m = cfg.block_m
    width = table.shape[1]
    grid = (b, hkv, triton.cdiv(max_rows, block_m))
    _prefill_kernel[grid](
        q, k_pool_l, v_pool_l, out, table, toks, tables.block_pos, tables.q_start, tables.cu_q, scale, width,
        q.stride(0), q.stride(1), k_pool_l.stride(0), k_pool_l.stride(1), k_pool_l.stride(2),
        G=g, HEAD_D=d, CHUNK=c, BLOCK_M=block_m, **cfg.constexprs(),
        BLOCK_W=prefill_block_w(width), **dot_flags(q.dtype, dev), **cfg.options(),
    )
    return out


def prefill_block_w(width: int) -> int:
    """The BLOCK_W constexpr for a table of ``width`` chunks per row: 16, 32, ..., 256 (a bucket)."""
    return max(16, min(256, triton.next_power_of_2(width)))
