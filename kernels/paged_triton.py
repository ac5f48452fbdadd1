"""PagedAttention baseline in Triton: one program per (row, kv head) reading every chunk of the row.

It is TPP's phase-2 kernel with no shared runs, fed the paged block table, so both backends use
the same inner loop and block sizes; only the algorithm differs.
"""

from __future__ import annotations

import torch

from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.tpp_triton import _tpp_phase2, block_sizes, check_triton_inputs, dot_modes


def paged_decode_triton(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: object | None = None,
) -> torch.Tensor:
    """Paged decode in Triton. q_sorted: [b, Hq, D] tree order; pools [Hkv, N, c, D] -> [b, Hq, D]."""
    check_triton_inputs(q_sorted, k_pool_l)
    b, hq, d = q_sorted.shape
    hkv, _n, c, _d = k_pool_l.shape
    g = hq // hkv
    q_sorted = q_sorted.contiguous()
    o = out if out is not None else torch.empty_like(q_sorted)
    block_d, block_n, block_g = block_sizes(d, c, g)
    qk_native, pv_tf32 = dot_modes(q_sorted.dtype, q_sorted.device)
    table = ctx.block_table.contiguous()
    width = table.shape[1]
    start = torch.arange(b, dtype=torch.int32, device=table.device) * width
    count = (ctx.block_tokens > 0).sum(dim=1, dtype=torch.int32)
    dummy = torch.zeros(1, dtype=torch.int32, device=q_sorted.device)
    dummy_f = torch.empty(1, dtype=torch.float32, device=q_sorted.device)
    _tpp_phase2[(b, hkv)](
        q_sorted, k_pool_l, v_pool_l, o, dummy_f, dummy_f, dummy_f, dummy, dummy, dummy, dummy,
        start, count, table, ctx.block_tokens.contiguous(), scale, 1, 1,
        q_sorted.stride(0), q_sorted.stride(1), o.stride(0), o.stride(1),
        k_pool_l.stride(0), k_pool_l.stride(1), k_pool_l.stride(2),
        HQ=hq, G=g, HEAD_D=d, CHUNK=c, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_RUNS=False, QK_NATIVE=qk_native, PV_TF32=pv_tf32,
    )
    return o
