"""PagedAttention baseline in PyTorch: every row reads all of its chunks, shared or not.

Same loop structure and building blocks as the TPP torch path (``torch_ops.dense_chunk_pass``
over ``ctx.block_table``), so the comparison isolates the algorithm: TPP reads a shared chunk
once per step, paged once per row.
"""

from __future__ import annotations

import torch
from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.torch_ops import dense_chunk_pass


def paged_decode_torch(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention. q_sorted: [b, Hq, D] tree order; pools [Hkv, N, c, D] -> [b, Hq, D]."""
    b, hq, d = q_sorted.shape
    hkv = k_pool_l.shape[0]
    g = hq // hkv
    qf = q_sorted.float()
    o_acc = torch.zeros(b, hkv, g, d, dtype=torch.float32, device=q_sorted.device)
    lse_acc = torch.full((b, hkv, g), float("-inf"), dtype=torch.float32, device=q_sorted.device)
    counts = [int(x) for x in (ctx.block_tokens > 0).sum(dim=1).tolist()]
    dense_chunk_pass(
        qf.view(b, hkv, g, d), k_pool_l, v_pool_l, ctx.block_table, ctx.block_tokens, counts, o_acc, lse_acc, scale
    )
    res = o_acc.view(b, hq, d)
    if out is None:
        return res.to(q_sorted.dtype)
    out.copy_(res)
    return out
