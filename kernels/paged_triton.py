"""PagedAttention baseline in Triton: one program per (row, kv head) reading every chunk of the row.

It is TPP's phase-2 kernel with no shared runs, fed the paged block table, so both backends use
the same inner loop, block sizes and kv split (flash-decoding for small batches); only the
algorithm differs.
"""

from __future__ import annotations

import torch

from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.tpp_triton import decode_phase2, pick_kv_split
from chunkserve.kernels.triton_common import check_triton_inputs, sm_count


def paged_decode_triton(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: object | None = None,
    kv_split: int | None = None,
) -> torch.Tensor:
    """Paged decode in Triton. q_sorted: [b, Hq, D] tree order; pools [Hkv, N, c, D] -> [b, Hq, D]."""
    check_triton_inputs(q_sorted, k_pool_l)
    b, hq, _d = q_sorted.shape
    hkv, _n, c, _d = k_pool_l.shape
    q_sorted = q_sorted.contiguous()
    o = out if out is not None else torch.empty_like(q_sorted)
    table = ctx.block_table.contiguous()
    width = table.shape[1]
    start = torch.arange(b, dtype=torch.int32, device=table.device) * width
    count = (ctx.block_tokens > 0).sum(dim=1, dtype=torch.int32)
    dummy_f = torch.empty(1, dtype=torch.float32, device=q_sorted.device)
    private = (start, count, table, ctx.block_tokens.contiguous())
    kv_split = kv_split or pick_kv_split(b * hkv, width, c, sm_count(q_sorted.device))
    decode_phase2(q_sorted, k_pool_l, v_pool_l, o, None, private, (dummy_f, dummy_f, dummy_f, 1, 1), scale,
                  kv_split)
    return o
