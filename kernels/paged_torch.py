"""PagedAttention baseline in PyTorch: every row reads all of its chunks, shared or not.

Same building blocks as the TPP torch path: on CPUs the in-place kernel (``cpu_kernel.py``) over
``ctx.block_table``, elsewhere ``torch_ops.dense_chunk_pass``, so the comparison isolates the
algorithm: TPP reads a shared chunk once per step, paged once per row.
"""

from __future__ import annotations

import torch

from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.cpu_kernel import inplace_kernel
from chunkserve.kernels.torch_ops import (
    Workspace,
    combine_partials,
    dense_chunk_pass,
    finish,
    group_size,
    num_groups,
)


def paged_decode_torch(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    inplace: bool | None = None,
) -> torch.Tensor:
    """Paged decode attention. q_sorted: [b, Hq, D] tree order; pools [Hkv, N, c, D] -> [b, Hq, D].

    ``inplace``: read every row's chunks in place through the CPU kernel (None = when available).
    """
    b, hq, d = q_sorted.shape
    hkv, _n, c, _d = k_pool_l.shape
    g = hq // hkv
    dev = q_sorted.device
    ws = workspace or Workspace()
    qf = q_sorted.float()
    kern = inplace_kernel(qf.view(b, hkv, g, d), k_pool_l, inplace)
    if kern is not None:
        res = ws.take("res", (b, hkv, g, d), torch.float32, dev)
        kern(qf.view(b, hkv, g, d), k_pool_l, v_pool_l, ctx.block_table, ctx.block_tokens, scale, res, None, ws)
        return finish(res.view(b, hq, d), q_sorted, out)
    counts = [int(x) for x in (ctx.block_tokens > 0).sum(dim=1).tolist()]
    group = group_size(counts, b, hkv, c, d, k_pool_l.element_size())
    slots = max(1, num_groups(counts, group))
    part_o = ws.take("part_o", (slots, b, hkv, g, d), torch.float32, dev).zero_()
    part_lse = ws.take("part_lse", (slots, b, hkv, g), torch.float32, dev).fill_(float("-inf"))
    dense_chunk_pass(qf.view(b, hkv, g, d), k_pool_l, v_pool_l, ctx.block_table, ctx.block_tokens, counts, group,
                     part_o, part_lse, scale, ws)
    res = combine_partials(part_o.view(slots, b, hq, d), part_lse.view(slots, b, hq),
                           ws.take("res", (b, hq, d), torch.float32, dev))
    return finish(res, q_sorted, out)
