"""Two-phase partition (TPP) decode attention in PyTorch (fast on CPUs, correct anywhere).

Phase 1 (chunk-first): for every shared run, the stacked queries of the rows it covers, with the
GQA heads of each kv head packed into rows (``[Hkv, (j-i)*g, D]``), attend the run's keys together.
On CPUs every run goes through one call of the in-place kernel (``cpu_kernel.run_attention``:
register-tiled, each key loaded once per run); elsewhere each run is one batched ATen call over a
view of the pool (consecutive chunk ids) or a gather. The partial (o, lse) in fp32 goes to one slot
of a partial stack (rows ``[i, j)`` of slot ``r``); at full sharing (one run over every row, nothing private)
that partial is the answer, and the CPU kernel reads an fp32 or bf16 q and writes ``out`` in q's dtype as they lie.

Phase 2 (sequence-first): the private chunks of all rows are attended position group by position
group (``torch_ops.dense_chunk_pass``), one more slot per group; then every row merges its slots
with one log-sum-exp (``combine_partials``: fixed order, no atomics, deterministic). Python loops
run over runs and chunk positions only.
"""

from __future__ import annotations

from typing import Any

import torch

from chunkserve.kernels.context import ChunkContext
from chunkserve.kernels.cpu_kernel import RunTable, inplace_kernel, run_attention
from chunkserve.kernels.torch_ops import (
    Workspace,
    combine_partials,
    dense_chunk_pass,
    finish,
    group_size,
    num_groups,
    partial_attention,
)


def _run_kv(pool: torch.Tensor, ctx: ChunkContext, r: int, ws: Workspace, name: str) -> torch.Tensor:
    """Run ``r``'s valid keys (or values) as [Hkv, T, D].

    Consecutive chunk ids: a view of the pool (no copy). Otherwise, when only the last chunk is
    partly filled, one chunk-granular gather; else (partly filled chunks inside the run, after a
    fork) a token-granular gather of exactly the valid tokens. Invalid slots are never read.
    """
    hkv, _n, c, d = pool.shape
    _i, _j, first, n, contiguous = ctx.runs_host[r]
    toks = ctx.run_token_lists[r]
    inner_full = all(t == c for t in toks[:-1])
    total = sum(toks)
    if contiguous and inner_full:
        return pool[:, first : first + n].reshape(hkv, n * c, d)[:, :total]
    ids = torch.tensor(ctx.run_chunk_lists[r], dtype=torch.int64, device=pool.device)
    if inner_full:
        buf = ws.take(name, (hkv, n, c, d), pool.dtype, pool.device)
        return torch.index_select(pool, 1, ids, out=buf).view(hkv, n * c, d)[:, :total]
    ar = torch.arange(c, device=pool.device)
    nt = torch.tensor(toks, dtype=torch.int64, device=pool.device)
    flat = (ids[:, None] * c + ar[None, :])[ar[None, :] < nt[:, None]]  # [total]
    buf = ws.take(name, (hkv, total, d), pool.dtype, pool.device)
    return torch.index_select(pool.reshape(hkv, -1, d), 1, flat, out=buf)


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


def memo_private_table(ctx: ChunkContext, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`private_table`, memoised per step: the same for every layer (the entry holds the context, so its id
    cannot be reused while it lives; owners clear the memo when token counts change)."""
    hit = ws.memo.get(("private_table", id(ctx)))
    if hit is None or hit[0] is not ctx:  # type: ignore[index]
        hit = (ctx, private_table(ctx))
        ws.remember(("private_table", id(ctx)), hit)
    return hit[1]  # type: ignore[index,return-value]


def memo_run_table(ctx: ChunkContext, ws: Workspace) -> RunTable:
    """The context's shared runs in the phase-1 kernel's layout, built once per step (memoised in ``ws``)."""
    rt: Any = ws.memo.get(("run_table", id(ctx)))
    if rt is None or rt[0] is not ctx:
        rt = (ctx, RunTable.build([r[:2] for r in ctx.runs_host], list(ctx.run_chunk_lists),
                                  list(ctx.run_token_lists)))
        ws.remember(("run_table", id(ctx)), rt)
    return rt[1]


def tpp_decode_torch(
    q_sorted: torch.Tensor,
    k_pool_l: torch.Tensor,
    v_pool_l: torch.Tensor,
    ctx: ChunkContext,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    inplace: bool | None = None,
) -> torch.Tensor:
    """TPP decode attention. q_sorted: [b, Hq, D] in tree order; pools: [Hkv, N, c, D] -> [b, Hq, D].

    ``out`` (optional, [b, Hq, D], q's dtype) receives the result. ``inplace``: phase 2 through the
    in-place CPU kernel (``cpu_kernel.py``; None = when it is available), else the gather path.
    """
    b, hq, d = q_sorted.shape
    hkv, _n, c, _d = k_pool_l.shape
    g = hq // hkv
    dev = q_sorted.device
    ws = workspace or Workspace()
    table, tokens, counts = memo_private_table(ctx, ws)
    q4 = q_sorted.view(b, hkv, g, d)  # splits one dim: a view of any q
    kern = inplace_kernel(q4, k_pool_l, inplace)
    if kern is not None:
        group = 0  # unused: the kernel covers every private chunk of a row in one slot
        slots = ctx.num_runs + (1 if max(counts, default=0) else 0)
    else:
        group = group_size(counts, b, hkv, c, d, k_pool_l.element_size())
        slots = ctx.num_runs + num_groups(counts, group)
    # one shared run over every row and nothing private (full sharing): its partial is the answer
    only_run = slots == 1 and ctx.num_runs == 1 and ctx.runs_host[0][1] - ctx.runs_host[0][0] == b
    runs_kernel = kern is not None and ctx.num_runs > 0 and kern.supports_runs(q4, k_pool_l)
    if only_run and runs_kernel and kern is not None and _direct(q_sorted, out):  # the kernel reads q, writes out
        res = out if out is not None else torch.empty_like(q_sorted)
        run_attention(kern, q4, k_pool_l, v_pool_l, memo_run_table(ctx, ws), scale, res.view(1, b, hkv, g, d),
                      ws.take("part_lse", (1, b, hkv, g), torch.float32, dev), ws)
        return res
    qf = q_sorted
    if q_sorted.dtype != torch.float32:
        qf = ws.take("tpp_qf", (b, hq, d), torch.float32, dev).copy_(q_sorted)
    if kern is not None and ctx.num_runs == 0:  # nothing shared: one in-place pass is the answer
        res = ws.take("res", (b, hkv, g, d), torch.float32, dev)
        kern(qf.view(b, hkv, g, d), k_pool_l, v_pool_l, table, tokens, scale, res, None, ws)
        return finish(res.view(b, hq, d), q_sorted, out)
    part_o = ws.take("part_o", (max(slots, 1), b, hkv, g, d), torch.float32, dev)
    part_lse = ws.take("part_lse", (max(slots, 1), b, hkv, g), torch.float32, dev)
    if not only_run:
        part_o[: ctx.num_runs].zero_()
        part_lse[: ctx.num_runs].fill_(float("-inf"))
    # phase 1: one batched partial per shared run, the queries of its rows stacked (GQA packed):
    # all runs in one in-place kernel call when it serves the shapes, else one ATen call per run
    if runs_kernel and kern is not None:
        run_attention(kern, qf.view(b, hkv, g, d), k_pool_l, v_pool_l, memo_run_table(ctx, ws), scale, part_o,
                      part_lse, ws)
    for r in range(0 if runs_kernel else ctx.num_runs):
        i, j = ctx.runs_host[r][0], ctx.runs_host[r][1]
        n = j - i
        q_run = qf[i:j].view(n, hkv, g, d).transpose(0, 1).reshape(1, hkv, n * g, d)
        k = _run_kv(k_pool_l, ctx, r, ws, "run_k").unsqueeze(0)  # [1, Hkv, T, D]
        v = _run_kv(v_pool_l, ctx, r, ws, "run_v").unsqueeze(0)
        o, lse = partial_attention(q_run, k, v, scale, None, ws)  # [1, Hkv, n*g, D], [1, Hkv, n*g]
        part_o[r, i:j].copy_(o.view(hkv, n, g, d).transpose(0, 1))
        part_lse[r, i:j].copy_(lse.view(hkv, n, g).transpose(0, 1))
    if only_run:
        return finish(part_o[0].view(b, hq, d), q_sorted, out)
    # phase 2: every row's private chunks (in place, or position group by position group), then one
    # merge per row
    if kern is not None:
        if slots > ctx.num_runs:
            kern(qf.view(b, hkv, g, d), k_pool_l, v_pool_l, table, tokens, scale, part_o[ctx.num_runs],
                 part_lse[ctx.num_runs], ws)
    else:
        part_o[ctx.num_runs :].zero_()
        part_lse[ctx.num_runs :].fill_(float("-inf"))
        dense_chunk_pass(qf.view(b, hkv, g, d), k_pool_l, v_pool_l, table, tokens, counts, group,
                         part_o[ctx.num_runs :], part_lse[ctx.num_runs :], scale, ws)
    res = combine_partials(part_o.view(-1, b, hq, d), part_lse.view(-1, b, hq),
                           ws.take("res", (b, hq, d), torch.float32, dev))
    return finish(res, q_sorted, out)


def _direct(q: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether the phase-1 kernel can read ``q`` and write ``out`` (or a new tensor like q) as they lie: fp32 or
    bf16, contiguous, on q's device, and ``out`` in storage of its own (an out over q's storage at other offsets
    could be written before the items that read those q rows have read them)."""
    if q.dtype not in (torch.float32, torch.bfloat16) or not q.is_contiguous():
        return False
    return out is None or (out.dtype == q.dtype and out.is_contiguous() and out.shape == q.shape
                           and out.device == q.device
                           and out.untyped_storage().data_ptr() != q.untyped_storage().data_ptr())
