"""Two-phase partition (TPP) decode attention in PyTorch (fast on CPUs, correct anywhere).

Phase 1 (chunk-first): for every shared run, the stacked queries of the rows it covers, with the
GQA heads of each kv head packed into rows (``[Hkv, (j-i)*g, D]``), attend the run's keys in one
batched call. A run stored in consecutive chunk ids is read as a view of the pool; its partial
(o, lse) in fp32 is merged into the rows' accumulators right away, in run order (deterministic).

Phase 2 (sequence-first): the private chunks of all rows are attended position group by position
group (``torch_ops.dense_chunk_pass``), merging into the same accumulators. Python loops run over
runs and chunk positions only.
"""

from __future__ import annotations

import torch
from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.torch_ops import dense_chunk_pass, merge_into, partial_attention


def _run_kv(
    pool: torch.Tensor, ctx: ChunkContext, r: int, flat_index: torch.Tensor | None
) -> torch.Tensor:
    """The run's valid keys (or values) as [Hkv, T, D]: a view when possible, else a gather."""
    hkv, _n, c, d = pool.shape
    _i, _j, first, n, contiguous = ctx.runs_host[r]
    if flat_index is None:  # contiguous, only the last chunk may be partly filled
        total = (n - 1) * c + ctx.run_token_lists[r][-1]
        return pool[:, first : first + n].reshape(hkv, n * c, d)[:, :total]
    return pool.reshape(hkv, -1, d).index_select(1, flat_index)


def _run_flat_index(ctx: ChunkContext, r: int, device: torch.device) -> torch.Tensor | None:
    """Flat pool token indices of run ``r``'s valid tokens, or None when a view covers them."""
    _i, _j, _first, _n, contiguous = ctx.runs_host[r]
    toks = ctx.run_token_lists[r]
    c = ctx.chunk_size
    if contiguous and all(t == c for t in toks[:-1]):
        return None
    idx = [ch * c + t for ch, nt in zip(ctx.run_chunk_lists[r], toks, strict=True) for t in range(nt)]
    return torch.tensor(idx, dtype=torch.int64, device=device)


def private_table(ctx: ChunkContext) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Dense [b, P] chunk-id and token tables of each row's private chunks, and host counts."""
    ptr = ctx.seq_chunk_ptr.to(torch.int64)
    counts_t = ptr[1:] - ptr[:-1]
    counts = [int(x) for x in counts_t.tolist()]
    b = len(counts)
    p_max = max(counts, default=0)
    dev = ctx.seq_chunks.device
    table = torch.zeros(b, max(p_max, 1), dtype=torch.int32, device=dev)
    tokens = torch.zeros(b, max(p_max, 1), dtype=torch.int32, device=dev)
    total = int(ctx.seq_chunks.numel())
    if total:
        rows = torch.repeat_interleave(torch.arange(b, device=dev), counts_t.to(dev))
        pos = torch.arange(total, device=dev) - ptr.to(dev)[:-1].index_select(0, rows)
        table[rows, pos] = ctx.seq_chunks
        tokens[rows, pos] = ctx.seq_tokens
    return table, tokens, counts


def tpp_decode_torch(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """TPP decode attention. q_sorted: [b, Hq, D] in tree order; pools: [Hkv, N, c, D] -> [b, Hq, D].

    ``out`` (optional, [b, Hq, D], q's dtype) receives the result.
    """
    b, hq, d = q_sorted.shape
    hkv = k_pool_l.shape[0]
    g = hq // hkv
    qf = q_sorted.float()  # [b, Hq, D]
    o_acc = torch.zeros(b, hkv, g, d, dtype=torch.float32, device=q_sorted.device)
    lse_acc = torch.full((b, hkv, g), float("-inf"), dtype=torch.float32, device=q_sorted.device)
    # phase 1: one batched partial per shared run, queries of its rows stacked (GQA packed)
    for r in range(ctx.num_runs):
        i, j = ctx.runs_host[r][0], ctx.runs_host[r][1]
        n = j - i
        q_run = qf[i:j].view(n, hkv, g, d).transpose(0, 1).reshape(1, hkv, n * g, d)
        flat = _run_flat_index(ctx, r, q_sorted.device)
        k = _run_kv(k_pool_l, ctx, r, flat).unsqueeze(0)  # [1, Hkv, T, D]
        v = _run_kv(v_pool_l, ctx, r, flat).unsqueeze(0)
        o, lse = partial_attention(q_run, k, v, scale)  # [1, Hkv, n*g, D], [1, Hkv, n*g]
        o = o.view(hkv, n, g, d).transpose(0, 1)
        lse = lse.view(hkv, n, g).transpose(0, 1)
        o_rows, lse_rows = o_acc[i:j], lse_acc[i:j]
        merge_into(o_rows, lse_rows, o, lse)
    # phase 2: private chunks, position group by position group
    table, tokens, counts = private_table(ctx)
    dense_chunk_pass(qf.view(b, hkv, g, d), k_pool_l, v_pool_l, table, tokens, counts, o_acc, lse_acc, scale)
    res = o_acc.view(b, hq, d)
    if out is None:
        return res.to(q_sorted.dtype)
    out.copy_(res)
    return out
