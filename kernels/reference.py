"""Reference decode attention: one sequence at a time, gather its keys, softmax in float64."""

from __future__ import annotations

import torch

from chunkserve.kernels.context import ChunkContext


def reference_decode(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: object | None = None,
) -> torch.Tensor:
    """Slow ground truth. q_sorted: [b, Hq, D] tree order; pools [Hkv, N, c, D] -> [b, Hq, D]."""
    b, hq, d = q_sorted.shape
    hkv, _n, c, _d = k_pool_l.shape
    g = hq // hkv
    res = torch.empty(b, hq, d, dtype=torch.float64, device=q_sorted.device)
    table = ctx.block_table.tolist()
    tokens = ctx.block_tokens.tolist()
    for s in range(b):
        ks, vs = [], []
        for ch, nt in zip(table[s], tokens[s], strict=True):
            if nt > 0:
                ks.append(k_pool_l[:, ch, :nt])
                vs.append(v_pool_l[:, ch, :nt])
        k = torch.cat(ks, dim=1).double().repeat_interleave(g, dim=0)  # [Hq, T, D]
        v = torch.cat(vs, dim=1).double().repeat_interleave(g, dim=0)
        qs = q_sorted[s].double().unsqueeze(1)  # [Hq, 1, D]
        w = torch.softmax(torch.matmul(qs, k.transpose(1, 2)) * scale, dim=-1)
        res[s] = torch.matmul(w, v).squeeze(1)
    if out is None:
        return res.to(q_sorted.dtype)
    out.copy_(res)
    return out
